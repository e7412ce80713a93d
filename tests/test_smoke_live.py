"""The live smoke's logic on CPU: the output comparison and its tolerance, the decode window,
the speed targets, what is read from a server's log, a launch's own verdicts, resuming, the
model, and the gate's refusals. The GPU run itself is the gate's (nox -s smoke on a GPU host)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kdtree_pipeline.smoke import compare as C
from kdtree_pipeline.smoke import gate, imports, live
from kdtree_pipeline.smoke import model as M

ROOT = Path(__file__).resolve().parents[1]


def _out(ids, lps, top2=None):
    return {"ids": ids, "logprobs": lps, "top2": top2 or [[[lp, i], [lp - 1.0, i + 1]] for i, lp in zip(ids, lps, strict=False)]}


# -- the comparison ----------------------------------------------------------------------------


def test_identical_runs_match_every_token():
    a = _out([5, 6, 7, 8], [-1.0, -2.0, -0.5, -3.0])
    r = C.compare_one(a, a)
    assert r["problems"] == [] and r["matched"] == 4 and r["max_logprob_diff"] == 0 and "flip" not in r


def test_logprobs_within_two_bf16_steps_pass_and_beyond_fail():
    off = _out([5, 6, 7], [-1.0, -2.0, -0.5])
    assert C.compare_one(off, _out([5, 6, 7], [-1.0, -2.2, -0.5]))["problems"] == []
    bad = C.compare_one(off, _out([5, 6, 7], [-1.0, -2.0, -0.9]))
    assert bad["problems"] == ["token 2: logprob -0.5000 off vs -0.9000 on, more than 0.25 apart"]


def test_a_flip_at_a_bf16_tie_to_the_runner_up_passes_and_ends_the_comparison():
    top2 = [[[-1.0, 5], [-3.0, 9]], [[-0.70, 6], [-0.80, 11]], [[-0.5, 7], [-2.0, 1]]]
    off = _out([5, 6, 7], [-1.0, -0.70, -0.5], top2)
    on = _out([5, 11, 3], [-1.0, -0.75, -9.0])  # after the flip anything goes: other context
    r = C.compare_one(off, on)
    assert r["problems"] == [] and r["matched"] == 1
    assert r["flip"] == {"at": 1, "off": 6, "on": 11, "off_top2": [6, 11], "margin": 0.1}


def test_a_flip_at_a_wide_margin_or_to_a_third_token_fails():
    top2 = [[[-1.0, 5], [-3.0, 9]], [[-0.2, 6], [-1.5, 11]]]
    off = _out([5, 6], [-1.0, -0.2], top2)
    wide = C.compare_one(off, _out([5, 11], [-1.0, -1.4]))
    assert "led its runner-up by 1.300 (> 0.25, not a bf16 tie)" in wide["problems"][0]
    tie = [[[-1.0, 5], [-3.0, 9]], [[-0.2, 6], [-0.3, 11]]]
    third = C.compare_one(_out([5, 6], [-1.0, -0.2], tie), _out([5, 42], [-1.0, -0.25]))
    assert "neither off's best 6 nor its runner-up 11" in third["problems"][0]


def test_the_first_token_comes_from_the_prefill_and_must_agree():
    r = C.compare_one(_out([5, 6], [-1.0, -2.0]), _out([4, 6], [-1.0, -2.0]))
    assert r["matched"] == 0 and "from the prefill" in r["problems"][0]


def test_missing_tokens_or_logprobs_are_problems_not_passes():
    assert C.compare_one(_out([5, 6], [-1, -2]), _out([5], [-1]))["problems"]
    assert C.compare_one({"ids": [5], "logprobs": []}, {"ids": [5], "logprobs": []})["problems"]
    both = C.compare({"4096": _out([5], [-1.0])}, {"23000": _out([5], [-1.0])})
    assert not both["passed"] and "answered by one run only" in both["problems"][0]


# -- decode speed ------------------------------------------------------------------------------


def _stream(times, tokens):
    return SimpleNamespace(times=times, events=[{"meta_info": {"completion_tokens": n}} for n in tokens],
                           latency_s=times[-1])


def test_the_decode_window_counts_only_where_every_request_decodes():
    a = _stream([1.0, 1.1, 1.2, 1.3, 1.4], [1, 2, 3, 4, 5])
    b = _stream([1.2, 1.3, 1.4, 1.5], [1, 3, 5, 7])  # prefilled later, two tokens a step
    w = live.decode_window([a, b])
    assert w["window_s"] == pytest.approx(0.2) and w["tokens"] == (5 - 3) + (5 - 1)
    assert w["tokens_per_s"] == pytest.approx(30.0) and w["steps"] == 2.0 and w["step_ms"] == pytest.approx(100.0)
    assert w["steps_from"] == "events"
    assert "no window" in live.decode_window([_stream([1.0, 1.1], [1, 2]), _stream([2.0, 2.1], [1, 2])])["error"]
    assert "streamed no tokens" in live.decode_window([SimpleNamespace(times=[], events=[])])["error"]


def test_the_decode_window_takes_the_steps_from_sglangs_verify_count():
    """SGLang sends one event for several queued steps: a request that made a token a step for
    eight steps but was seen in four events decoded eight steps, as its spec_verify_ct says."""
    a = _stream([1.0, 1.2, 1.4, 1.6, 1.8], [1, 3, 5, 7, 9])  # 4 events in the window, 2 tokens each
    b = _stream([1.0, 1.2, 1.4, 1.6, 1.8], [1, 3, 5, 7, 9])
    for s in (a, b):
        s.events[-1]["meta_info"]["spec_verify_ct"] = 8  # (9 - 1) tokens after the prefill's, 1 a step
    w = live.decode_window([a, b])
    assert w["steps_from"] == "spec_verify_ct" and w["tokens"] == 16
    assert w["steps"] == 8.0 and w["step_ms"] == pytest.approx(100.0) and w["accept_length"] == pytest.approx(1.0)
    b.events[-1]["meta_info"].pop("spec_verify_ct")  # one request without the count: events for all
    assert live.decode_window([a, b])["steps_from"] == "events"


def _result(name, speed=None, **kw):
    r = live.LaunchResult(name, {})
    r.checks = {"speed": speed or {}}
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def _speed(step_ms_by_len):
    return {f"{n}x1": {"length": n, "bs": 1, "tokens_per_s": 1000.0 / ms, "step_ms": ms}
            for n, ms in step_ms_by_len.items()}


def test_speed_targets_two_x_at_23k_and_more_at_longer_prompts():
    off = _result("off-eager", _speed({23000: 30.0, 65536: 60.0, 91000: 80.0}))
    on = _result("on-eager", _speed({23000: 12.0, 65536: 13.0, 91000: 14.0}))
    rows = gate.speed_table({"off-eager": off, "on-eager": on})
    assert [r["speedup"] for r in rows] == [2.5, 4.62, 5.71]
    assert rows[0]["attention_share_off_min"] == pytest.approx(0.6)
    assert gate.speed_targets(rows) == []
    slow = _result("on-eager", _speed({23000: 20.0, 65536: 40.0, 91000: 60.0}))
    got = gate.speed_targets(gate.speed_table({"off-eager": off, "on-eager": slow}))
    assert got[0] == "decode at 23000 tokens, bs 1, eager: kernel on 1.5x off, target >= 2.0x"
    assert any("less than the 1.5x at 23000" in p for p in got)
    assert gate.speed_targets([]) == ["no eager speed runs of both kernel off and on"]


# -- what a server's log says ------------------------------------------------------------------


def test_the_plugins_own_messages_are_what_the_log_reader_reads(tmp_path, caplog, monkeypatch):
    """Feed the reader the plugin's real log lines, formatted as SGLang's logger prints them."""
    from kdtree_engine.sglang import plugin

    r = plugin._Runtime()
    with caplog.at_level(logging.INFO, logger="kdtree_engine.sglang"):
        plugin.logger.info("kdtree verify [%s]: hook registered on %s.%s (%s=on; library %s, built for %s); the "
                           "device is checked at the first verify step", "pid 1", plugin.TARGET_CLASS,
                           plugin.TARGET_METHOD, plugin.ENV, "/x.so", "sm_90a")
        r.note("not a TARGET_VERIFY forward", logging.INFO)
        r.note(plugin.K_REFUSED, logging.WARNING, "why")
        for _ in range(5):
            r.count_kernel_call()
    log = tmp_path / "server.log"
    log.write_text("\n".join(f"[2026-12-08 00:00:00 TP0] {m.getMessage()}" for m in caplog.records) + "\n"
                   "[2026-12-08] Decode batch, #running-req: 1, accept len: 1.00, cuda graph: True, gen throughput "
                   "(token/s): 50.0\n")
    got = live.read_plugin_lines(log)
    assert got["hooked"] and got["kernel_calls"] == 4 and got["verify_fallbacks"] == 1
    assert got["fallback_kinds"] == ["kernel refused the batch (why)", "not a TARGET_VERIFY forward"]
    assert got["cuda_graph_steps"] == 1 and got["refusal"] is None


def test_the_typo_message_is_what_the_log_reader_looks_for(tmp_path, monkeypatch):
    from kdtree_engine.sglang import plugin

    monkeypatch.setenv(plugin.ENV, "typo")
    with pytest.raises(plugin.KdtreeConfigExit) as e:
        plugin.load()
    (tmp_path / "s.log").write_text(f"Traceback ...\n{e.value}\n")
    assert "KDTREE_VERIFY='typo'" in live.read_plugin_lines(tmp_path / "s.log")["refusal"]


# -- a launch's own verdicts ---------------------------------------------------------------------


def _judged(launch, **fields):
    r = live.LaunchResult(launch.name, {}, ready_s=10.0)
    r.cleanup = {"processes_left": [], "gpu_mem_before_mib": 1000, "gpu_mem_after_mib": 1100}
    for k, v in fields.items():
        setattr(r, k, v)
    live.Run._judge(None, launch, r)
    return r.problems


def test_an_on_launch_must_show_the_hook_kernel_calls_and_no_fallback():
    on = live.LAUNCHES["on-eager"]
    ok = {"hooked": True, "kernel_calls": 64, "verify_fallbacks": 0, "off": []}
    assert [p for p in _judged(on, plugin=ok) if "hook" in p or "kernel" in p or "fallback" in p] == []
    got = _judged(on, plugin={"hooked": False, "kernel_calls": None, "verify_fallbacks": 3,
                              "fallback_kinds": ["x"], "off": []})
    assert "the plugin did not log that it hooked TritonAttnBackend.forward_extend" in got
    assert any(p.startswith("no kernel calls logged") for p in got)
    assert "3 verify calls went to SGLang's path: ['x']" in got


def test_cleanup_and_refusal_and_missing_library_verdicts():
    left = _judged(live.LAUNCHES["off-eager"], plugin={"off": [": off: KDTREE_VERIFY=off"]},
                   cleanup={"processes_left": [123], "gpu_mem_before_mib": 1000, "gpu_mem_after_mib": 9000})
    assert "processes left after the stop: [123]" in left
    assert any(p.startswith("GPU memory not given back: 9000 MiB") for p in left)
    typo = _judged(live.LAUNCHES["typo"], checks={"refuse": {"exit": "the server process (pid 1) exited with code 0"}},
                   plugin={"refusal": None})
    assert len(typo) == 2 and "did not stop the launch" in typo[0]
    nolib = _judged(live.LAUNCHES["no-library"], checks={"serve": {"tokens": 16}},
                    plugin={"off": [" [pid 1]: off: kernel library failed to load: ..."]})
    assert nolib == []


def test_a_run_resumes_only_launches_done_on_the_same_code(tmp_path):
    run = live.Run(tmp_path / "run", tmp_path / "m", [], root=ROOT, code="hash-a")
    r = live.LaunchResult("off-eager", {"name": "off-eager"}, ready_s=3.0)
    run.save(r)
    assert run.done("off-eager").ready_s == 3.0
    assert live.Run(tmp_path / "run", tmp_path / "m", [], root=ROOT, code="hash-b").done("off-eager") is None
    (tmp_path / "run" / "launch-on-eager.json").write_text("{ truncated")
    assert run.done("on-eager") is None


def test_a_bundle_made_again_is_a_new_site_for_the_saved_launches(tmp_path):
    bundle = tmp_path / "live.tar.xz"
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "mod.py").write_text("")
    subprocess.run(["tar", "-cJf", str(bundle), "-C", str(tmp_path / "x"), "mod.py"], check=True)
    site = live.prepare_site(bundle, tmp_path / "site")
    first = live.site_stamp(site)
    assert live.site_stamp(live.prepare_site(bundle, tmp_path / "site")) == first  # kept, not unpacked again
    os.utime(bundle, (1, 1))  # a copy of the same bundle (a device call's) is the same site
    assert live.site_stamp(live.prepare_site(bundle, tmp_path / "site")) == first
    (tmp_path / "x" / "extra.py").write_text("")
    subprocess.run(["tar", "-cJf", str(bundle), "-C", str(tmp_path / "x"), "mod.py", "extra.py"], check=True)
    assert live.site_stamp(live.prepare_site(bundle, tmp_path / "site")) != first
    assert (tmp_path / "site" / "extra.py").is_file()
    assert live.site_stamp(tmp_path / "x") == str((tmp_path / "x").resolve())  # an unpacked folder given as is


def test_the_server_finds_the_plugin_by_the_entry_point_pyproject_declares(tmp_path):
    d = live.entry_point_dir(ROOT, tmp_path)
    (info,) = d.iterdir()
    assert info.name == "kdtree_engine-0.1.0.dist-info"
    assert "[sglang.srt.plugins]\nkdtree_verify = kdtree_engine.sglang.plugin:load" in (info / "entry_points.txt").read_text()


def test_every_server_gets_the_triton_backend_the_spec_and_its_graph_mode():
    argv = live.server_argv(live.LAUNCHES["on-graphs"], Path("/m"), 30999, python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"] and "--disable-cuda-graph" not in argv
    assert argv[argv.index("--attention-backend") + 1] == "triton"
    assert argv[argv.index("--speculative-eagle-topk") + 1] == "4"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "16"
    assert "--disable-cuda-graph" in live.server_argv(live.LAUNCHES["off-eager"], Path("/m"), 1)
    env = live.server_env(live.LAUNCHES["no-library"], [Path("/a"), Path("/b")], Path("/c"))
    assert env["PYTHONPATH"] == "/a:/b" and env["KDTREE_VERIFY"] == "on" and env["KDTREE_LIB"].startswith("/nonexistent")
    # SGLang's warmup limit (600 s unless set) is the gate's wait for the server, not shorter
    assert env["SGLANG_WARMUP_TIMEOUT"] == "1500"
    assert live.server_env(live.LAUNCHES["off-eager"], [], Path("/c"), 900.0)["SGLANG_WARMUP_TIMEOUT"] == "900"


def test_prompts_are_the_same_in_every_launch_and_inside_the_vocabulary():
    assert live.prompt(4096, 0) == live.prompt(4096, 0) != live.prompt(4096, 1)
    assert len(live.prompt(23000, 0)) == 23000
    assert all(live.TOKEN_RANGE[0] <= t < live.TOKEN_RANGE[1] < M.ModelSpec().vocab_size for t in live.prompt(512, 3))


# -- the model ---------------------------------------------------------------------------------


def test_the_model_is_one_tp8_rank_of_kimi_k26_per_layer():
    spec = M.ModelSpec()
    c = M.config(spec)
    assert (c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]) \
        == (7168, 8, 1536, 512, 64)
    assert c["first_k_dense_replace"] == c["num_hidden_layers"] == 4 and c["num_nextn_predict_layers"] == 1
    names = {t[0]: t[1] for t in M.tensors(spec)}
    assert names["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert names["model.layers.3.self_attn.q_b_proj.weight"] == (8 * 192, 1536)
    assert names["model.layers.4.eh_proj.weight"] == (7168, 14336)  # the MTP layer after the main ones
    assert names["model.layers.4.mlp.experts.7.down_proj.weight"] == (7168, 256)
    assert "model.layers.4.embed_tokens.weight" not in names  # shared from the target model
    assert M.nbytes(spec) == pytest.approx(5.27 * 2**30, rel=0.01)
    with pytest.raises(ValueError, match="layers: expected at least 2"):
        M.ModelSpec(layers=1)


def test_the_model_is_written_once_per_spec_and_reproducibly(tmp_path):
    pytest.importorskip("safetensors")
    small = M.ModelSpec(layers=2, hidden_size=64, intermediate_size=32, vocab_size=256, experts=2,
                        moe_intermediate_size=16, heads=2)
    first = M.write(tmp_path / "a", small, device="cpu")
    assert first["written"] and (tmp_path / "a" / M.STAMP).is_file()
    assert M.write(tmp_path / "a", small, device="cpu")["written"] is False
    M.write(tmp_path / "b", small, device="cpu")
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    for fname in set(index["weight_map"].values()):
        assert (tmp_path / "a" / fname).read_bytes() == (tmp_path / "b" / fname).read_bytes()


# -- the gate's refusals -----------------------------------------------------------------------


def test_bad_arguments_are_named():
    p = gate.build_parser()
    with pytest.raises(gate.UsageError, match="--launches: expected names from"):
        gate.validate(p.parse_args(["--launches", "off-eager,nope"]))
    with pytest.raises(gate.UsageError, match="--layers: expected at least 2"):
        gate.validate(p.parse_args(["--layers", "1"]))
    assert gate.validate(p.parse_args([])) == list(live.DEFAULT_LAUNCHES)


def test_without_a_gpu_the_gate_fails_with_one_sentence_and_a_record(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path / "ev"))
    monkeypatch.setattr(gate.shutil, "which", lambda name: None)
    assert gate.main(["--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "smoke: FAILED: the smoke gate starts SGLang on a GPU and this machine has no nvidia-smi" in err
    rec = json.loads((tmp_path / "ev" / "smoke.json").read_text())
    assert rec["passed"] is False and "no nvidia-smi" in rec["reason"]
    assert not (tmp_path / "run").exists()  # nothing started, nothing unpacked


def _package(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_the_import_check_names_every_missing_package_in_one_run(tmp_path):
    _package(tmp_path, {"srv/__init__.py": "", "srv/a.py": "import dillx\nfrom dillx.detect import trace\nX = dillx.P(1)\n",
                        "srv/b.py": "import zmqx\nclass S(zmqx.Socket):\n    pass\n", "srv/ok.py": "import json\n"})
    problems = imports.check(sys.executable, {"PYTHONPATH": str(tmp_path)}, ["srv.a", "srv.ok", "srv.b"])
    assert problems == ["the live bundle lacks dillx (imported under srv.a), zmqx (imported under srv.b): "
                        "add the packages to tools/live_site.py and make the bundle again"]
    assert imports.check(sys.executable, {"PYTHONPATH": str(tmp_path)}, ["srv.ok"]) == []


def test_the_import_check_stops_at_a_fault_that_is_not_a_missing_package(tmp_path):
    _package(tmp_path, {"srv/__init__.py": "", "srv/boom.py": "raise RuntimeError('no GPU driver')\n",
                        "srv/sub.py": "import srv.nosuch\n", "srv/later.py": "import never_reached_x\n"})
    env = {"PYTHONPATH": str(tmp_path)}
    assert imports.check(sys.executable, env, ["srv.boom", "srv.later"]) == [
        "importing srv.boom failed: RuntimeError: no GPU driver"]
    # a module of a package that is there is that package's fault, not the bundle's
    assert imports.check(sys.executable, env, ["srv.sub"]) == [
        "importing srv.sub failed: ModuleNotFoundError: No module named 'srv.nosuch'"]
    assert "exited" in imports.check(sys.executable, {"PYTHONPATH": str(tmp_path), "PYTHONHOME": "/nonexistent"},
                                     ["srv.sub"])[0]
