"""Pass-key prompt construction and baseline fingerprints."""

from __future__ import annotations

import json

import pytest

from kdtree_pipeline.smoke.checks import approx_tokens, first_number, passkey_prompt
from kdtree_pipeline.smoke.fingerprint import (
    BF16_NOTE,
    FingerprintError,
    compare,
    load_baseline,
    make_fingerprint,
    save_baseline,
    side_by_side,
)


@pytest.mark.parametrize("target", [1, 50, 1000, 23000, 91000])
def test_passkey_prompt_reaches_the_target(target):
    p = passkey_prompt(target, seed=3)
    assert p.approx_tokens == approx_tokens(p.text) >= target
    # not wildly over: at most one filler block beyond the target plus the fixed text
    assert p.approx_tokens <= max(target, 60) + 60
    assert p.text.count(p.passkey) == 2 and len(p.passkey) == 5
    assert p.text.endswith("The pass key is")


def test_passkey_depends_on_seed_and_sits_at_depth():
    a, b = passkey_prompt(2000, seed=1), passkey_prompt(2000, seed=2)
    assert a.passkey != b.passkey
    assert passkey_prompt(2000, seed=1) == a
    pos = a.text.index(a.passkey) / len(a.text)
    assert 0.4 < pos < 0.6
    early = passkey_prompt(2000, seed=1, depth=0.0)
    assert early.text.index(early.passkey) / len(early.text) < 0.05


def test_passkey_prompt_rejects_bad_target():
    with pytest.raises(ValueError, match="--long-tokens"):
        passkey_prompt(0)


def test_first_number():
    assert first_number(" 48213. Remember") == "48213"
    assert first_number(" I do not know") is None


def fp(**kw):
    base = dict(kdtree_verify="off", model="m", prompts={"short_prompt": "p", "long_tokens": 100},
                short_text=" Paris. It is", long_answer="12345", long_text=" 12345.")
    base.update(kw)
    return make_fingerprint(**base)


def test_round_trip_and_identical_compare(tmp_path):
    path = save_baseline(tmp_path / "b.json", fp())
    base = load_baseline(path)
    res = compare(base, fp(kdtree_verify="on"))
    assert res["passed"] and res["short_match"] and res["long_answer_match"]
    assert res["problems"] == []
    assert res["side_by_side"][0] == "short prompt: identical"


def test_difference_is_shown_side_by_side_with_the_bf16_note():
    res = compare(fp(), fp(kdtree_verify="on", short_text=" Paris. The city"))
    assert not res["passed"] and not res["short_match"] and res["long_answer_match"]
    text = "\n".join(res["side_by_side"])
    assert "short prompt: differs from character 8" in text
    assert "' Paris. It is'" in text and "' Paris. The city'" in text
    assert "baseline (KDTREE_VERIFY=off)" in text and "current (KDTREE_VERIFY=on)" in text
    assert res["note"] == BF16_NOTE and "bf16" in BF16_NOTE


def test_long_answer_and_setting_mismatches_are_problems():
    res = compare(fp(), fp(kdtree_verify="on", long_answer="99999", model="other",
                           prompts={"short_prompt": "p", "long_tokens": 200}))
    joined = " ".join(res["problems"])
    assert not res["passed"]
    assert "long-context answer differs" in joined and "'99999'" in joined
    assert "model 'm'" in joined and "long_tokens" in joined


def test_baseline_recorded_with_kdtree_on_is_refused():
    res = compare(fp(kdtree_verify="on"), fp(kdtree_verify="on"))
    assert not res["passed"] and "expected 'off'" in res["problems"][0]


def test_side_by_side_wraps_long_text():
    lines = side_by_side("x", "a" * 130, "a" * 129 + "b", width=40)
    assert lines[0] == "x: differs from character 129"
    assert len(lines) == 2 + 4  # repr adds quotes: 132 chars -> 4 rows of 40


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "holds a list"),
        ('{"schema": 1}', "lacks keys"),
    ],
)
def test_bad_baseline_files(tmp_path, content, message):
    path = tmp_path / "baseline.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(FingerprintError, match=message) as ei:
        load_baseline(path)
    assert "--compare-baseline" in str(ei.value) and str(path) in str(ei.value)


def test_wrong_schema_is_refused(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({**fp(), "schema": 99}))
    with pytest.raises(FingerprintError, match="schema 99"):
        load_baseline(path)
