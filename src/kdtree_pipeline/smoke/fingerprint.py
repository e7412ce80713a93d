"""Output fingerprints: record answers with ``KDTREE_VERIFY=off``, compare with ``on``.

At temperature 0 the short prompt's text must match exactly and the
long-context check must give the same answer. Differences are shown side by
side. bf16 arithmetic is not associative, so a different (but correct) kernel
can flip a near-tie between two tokens and change the text from that token on;
the note says so, and the verdict still counts it as a difference.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SCHEMA = 1
BF16_NOTE = (
    "note: bf16 arithmetic is not associative, so a different kernel (or batch) can "
    "flip a near-tie between two tokens at temperature 0 and change every later token; "
    "a difference that starts late in the text is less alarming than a wrong first token "
    "or a wrong long-context answer."
)
REQUIRED = ("schema", "kdtree_verify", "model", "prompts", "short_text", "long_answer", "long_text")


class FingerprintError(ValueError):
    """A baseline file is missing, unreadable or malformed."""


def make_fingerprint(
    *,
    kdtree_verify: str,
    model: str,
    prompts: dict[str, Any],
    short_text: str,
    long_answer: str | None,
    long_text: str,
) -> dict[str, Any]:
    """The outputs one run produced, with what is needed to tell if two runs are comparable
    (``prompts``: the settings and a hash of each prompt)."""
    return {
        "schema": SCHEMA,
        "kdtree_verify": kdtree_verify,
        "model": model,
        "prompts": prompts,
        "short_text": short_text,
        "long_answer": long_answer,
        "long_text": long_text,
    }


def save_baseline(path: Path | str, fingerprint: dict[str, Any]) -> Path:
    """Write the baseline atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def load_baseline(path: Path | str) -> dict[str, Any]:
    """Read a baseline written by :func:`save_baseline`; :class:`FingerprintError` otherwise."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FingerprintError(
            f"--compare-baseline: baseline file {str(path)!r} does not exist "
            "(record one first with --record-baseline FILE --kdtree off)"
        ) from None
    except OSError as e:
        raise FingerprintError(
            f"--compare-baseline: cannot read {str(path)!r} ({e.strerror or e})"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise FingerprintError(
            f"--compare-baseline: {str(path)!r} is not valid JSON ({e}); expected a baseline "
            "written by --record-baseline"
        ) from None
    if not isinstance(data, dict):
        raise FingerprintError(
            f"--compare-baseline: {str(path)!r} holds a {type(data).__name__}, expected a JSON "
            "object written by --record-baseline"
        )
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise FingerprintError(
            f"--compare-baseline: {str(path)!r} lacks keys {missing}; expected a baseline "
            "written by --record-baseline"
        )
    if data["schema"] != SCHEMA:
        raise FingerprintError(
            f"--compare-baseline: {str(path)!r} has schema {data['schema']!r}, expected {SCHEMA}"
        )
    return data


def first_difference(a: str, b: str) -> int | None:
    """Index of the first differing character, or None when equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def side_by_side(label: str, base: str, cur: str, width: int = 60) -> list[str]:
    """Lines showing ``base`` (off) and ``cur`` (on) in two columns, with the first
    differing position marked."""
    i = first_difference(base, cur)
    head = f"{label}: identical" if i is None else f"{label}: differs from character {i}"
    lines = [head, f"  {'baseline (KDTREE_VERIFY=off)':<{width}} | current (KDTREE_VERIFY=on)"]
    left, right = repr(base), repr(cur)
    for k in range(0, max(len(left), len(right)), width):
        lines.append(f"  {left[k:k + width]:<{width}} | {right[k:k + width]}")
    return lines


def compare(baseline: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """Compare two fingerprints. Returns ``{"passed", "problems", "short_match",
    "long_answer_match", "side_by_side", "note"}``."""
    problems: list[str] = []
    if baseline.get("kdtree_verify") != "off":
        problems.append(
            f"the baseline was recorded with KDTREE_VERIFY={baseline.get('kdtree_verify')!r}, "
            "expected 'off'"
        )
    if baseline["model"] != current["model"]:
        problems.append(
            f"the baseline is for model {baseline['model']!r}, the server serves {current['model']!r}"
        )
    if baseline["prompts"] != current["prompts"]:
        diff = sorted(
            k
            for k in set(baseline["prompts"]) | set(current["prompts"])
            if baseline["prompts"].get(k) != current["prompts"].get(k)
        )
        problems.append(
            f"the baseline was recorded with different prompt settings ({', '.join(diff)}); "
            "rerun with the same --prompt/--expect/--max-tokens/--long-tokens/--passkey-seed"
        )
    short_match = baseline["short_text"] == current["short_text"]
    long_match = (
        baseline["long_answer"] is not None and baseline["long_answer"] == current["long_answer"]
    )
    if not short_match:
        problems.append("the short prompt's text differs from the baseline at temperature 0")
    if not long_match:
        problems.append(
            f"the long-context answer differs: baseline {baseline['long_answer']!r}, "
            f"current {current['long_answer']!r}"
        )
    lines = side_by_side("short prompt", baseline["short_text"], current["short_text"])
    lines += side_by_side(
        "long-context answer", str(baseline["long_answer"]), str(current["long_answer"])
    )
    if baseline["long_text"] != current["long_text"]:
        lines += side_by_side("long-context text", baseline["long_text"], current["long_text"])
    return {
        "passed": not problems,
        "problems": problems,
        "short_match": short_match,
        "long_answer_match": long_match,
        "side_by_side": lines,
        "note": BF16_NOTE,
    }
