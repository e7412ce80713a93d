"""The bench gate's command line, its no-GPU failure, and a whole run on a simulated CUDA (CPU).

The simulated CUDA replaces the few ``torch.cuda`` entry points the bench uses
(events timed with the host clock, a graph that replays the runners recorded
during capture, no-op synchronisation) and the peers by small fakes: the
gate's control flow, error handling, report and evidence are the real ones.
The real thing runs under the ``gpu`` marker.
"""

from __future__ import annotations

import json
import time
import types
import zlib
from contextlib import contextmanager

import pytest
import torch

from kdtree_pipeline import evidence
from kdtree_pipeline.bench import gate, peers, roofline, suites
from kdtree_pipeline.bench.suites import Case, Suite
from kdtree_pipeline.oracle import reference


@pytest.fixture(autouse=True)
def _evidence_in_tmp(tmp_path, monkeypatch):
    """Every gate run here writes its evidence record in the test's tmp_path."""
    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path))


def test_bad_suite_and_systems_exit_2(capsys, tmp_path):
    assert gate.main(["--suite", "nano"]) == 2
    err = capsys.readouterr().err
    assert "--suite: expected one of micro, long-context, fragmentation, graph, got 'nano'" in err
    assert gate.main(["--systems", "ours,trtllm"]) == 2
    assert "unknown system(s) trtllm" in capsys.readouterr().err
    assert gate.main(["--budget-s", "-5"]) == 2
    assert "--budget-s: expected a positive number" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gate.main(["--frobnicate"])
    assert e.value.code == 2
    assert not list(tmp_path.iterdir())  # bad usage writes nothing


def test_list_needs_no_gpu(capsys):
    assert gate.main(["--suite", "long-context", "--list"]) == 0
    out = capsys.readouterr().out
    assert "bs1-N64-H8-L91000" in out and "10 cases" in out and "extend_50x" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU failure")
def test_no_cuda_fails_with_one_sentence(tmp_path, capsys):
    assert gate.main(["--suite", "graph", "--out", str(tmp_path / "o")]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    rec = evidence.load_record(tmp_path / "bench-graph.json")
    assert rec["passed"] is False and rec["variant"] == "graph" and "CUDA" in rec["reason"]


# ----------------------------------------------------------------------------- simulated CUDA


class _State:
    capture = None


class _Event:
    def __init__(self, enable_timing: bool = False):
        self.t = 0.0

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other: _Event) -> float:
        return (other.t - self.t) * 1e3


class _Graph:
    def __init__(self):
        self.calls = []

    def replay(self):
        for f in self.calls:
            f()


class _Stream:
    def wait_stream(self, other):
        pass


@contextmanager
def _graph(g, **kw):
    _State.capture = g
    try:
        yield
    finally:
        _State.capture = None


@contextmanager
def _stream(s):
    yield


def _runner(batch, delay_s=0.0, capturable=True, fail=False):
    out = torch.full((batch.q.shape[0], batch.q.shape[1], 512), float("nan"), dtype=torch.bfloat16)

    def run():
        if _State.capture is not None:
            if not capturable:
                raise RuntimeError("operation not permitted when stream is capturing")
            _State.capture.calls.append(run_now)
            return out
        return run_now()

    def run_now():
        if fail:
            raise RuntimeError("simulated peer crash")
        if delay_s:
            time.sleep(delay_s)
        out.copy_(reference.verify_attention_ref(*batch.ref_args())[0])
        return out

    return run


class _Fake(peers.Peer):
    def __init__(self, name, trees=True, missing=None, unsupported=False, **kw):
        self.name, self.label, self.supports_trees = name, name, trees
        self._missing, self._unsupported, self._kw = missing, unsupported, kw

    def check(self):
        return self._missing

    def prepare(self, batch):
        if self._unsupported:
            raise peers.PeerUnsupported("simulated: cannot handle this case")
        return _runner(batch, **self._kw)


@pytest.fixture
def fake_cuda(monkeypatch):
    props = types.SimpleNamespace(name="NVIDIA H200 (simulated)", major=9, minor=0, multi_processor_count=132,
                                  L2_cache_size=200_000, total_memory=141 << 30)
    c = torch.cuda
    for name, val in {"is_available": lambda: True, "get_device_properties": lambda *a: props,
                      "current_device": lambda: 0, "synchronize": lambda *a, **k: None, "Event": _Event,
                      "Stream": _Stream, "current_stream": lambda *a: _Stream(), "stream": _stream,
                      "CUDAGraph": _Graph, "graph": _graph, "empty_cache": lambda: None}.items():
        monkeypatch.setattr(c, name, val)
    monkeypatch.setattr(roofline, "measure", lambda: roofline.Ceilings(4.27e12, 790e12))
    monkeypatch.setattr(gate, "_cuda_alive", lambda: None)
    monkeypatch.setattr(gate, "DEVICE", "cpu")
    monkeypatch.setattr(gate, "MEASURE_BUDGET_S", 0.01)
    fakes = {p.name: p for p in (
        _Fake("ours"),
        _Fake("ours-sm120"),
        _Fake("sglang-extend", delay_s=0.002, fail=False),
        _Fake("sglang-splitkv", trees=False, capturable=False),
        _Fake("flashmla", trees=False, missing="ModuleNotFoundError: No module named 'flash_mla'"),
    )}
    monkeypatch.setattr(peers, "PEERS", fakes)
    return fakes


TINY = (Case(1, 4, 2, 40), Case(2, 3, 2, 90))


def _suite(monkeypatch, targets, systems=suites.SYSTEMS, kind="compare", name="tiny", cases=TINY):
    s = Suite(name, "a tiny simulated suite", cases, systems, targets, budget_s=60, kind=kind)
    monkeypatch.setitem(suites.SUITES, name, s)
    return s


def _run(tmp_path, *args):
    code = gate.main(["--suite", "tiny", "--out", str(tmp_path / "out"), *args])
    rec = evidence.load_record(tmp_path / "bench-tiny.json")
    return code, rec


def test_simulated_run_records_every_status(fake_cuda, monkeypatch, tmp_path, capsys):
    _suite(monkeypatch, ("tree_vs_chain", "flashmla", "splitkv"))
    fake_cuda["sglang-extend"]._kw["fail"] = True  # a crashing peer
    code, rec = _run(tmp_path)
    out = capsys.readouterr().out
    assert code == 1 and rec["passed"] is False  # FlashMLA is missing: its target is unmeasured
    assert "flashmla: UNMEASURED" in rec["reason"]
    st = {(r["case"], r["system"], r["mask"]): r for r in rec["details"]["results"]}
    for c in TINY:
        assert st[(c.name, "ours", "tree")]["status"] == "ok" and st[(c.name, "ours", "chain")]["status"] == "ok"
        assert st[(c.name, "ours", "tree")]["replay_us"] > 0 and st[(c.name, "ours", "tree")]["eager_us"] > 0
        assert st[(c.name, "ours", "tree")]["check"]["passed"]
        assert st[(c.name, "flashmla", "chain")]["status"] == "missing"
        assert st[(c.name, "sglang-extend", "tree")]["status"] == "error"
        assert "simulated peer crash" in st[(c.name, "sglang-extend", "tree")]["error"]
        sk = st[(c.name, "sglang-splitkv", "chain")]
        assert sk["status"] == "ok" and sk["replay_us"] is None and sk["eager_us"] > 0
        assert "stream is capturing" in sk["graph_error"]
        assert (c.name, "sglang-splitkv", "tree") not in st  # chain-only peer
    assert rec["variant"] == "tiny" and rec["metrics"]["missing"] == ["flashmla"]
    table = rec["details"]["markdown_table"]
    assert table.splitlines()[0].startswith("| case | ours tree | ours chain | SGLang extend")
    assert "(eager)" in table and "missing" in table and "error" in table
    report = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert len(report["results"]) == len(rec["details"]["results"])
    assert (tmp_path / "out" / "tiny.md").exists()
    assert "MISSING" in out and "[2/2]" in out  # progress printed


def test_simulated_wrong_output_and_unsupported(fake_cuda, monkeypatch, tmp_path):
    _suite(monkeypatch, ())
    fake_cuda["sglang-splitkv"]._unsupported = True
    real = fake_cuda["ours"].prepare

    def lying(batch):  # writes its output only on replay: the eager check must catch it
        run = real(batch)
        return lambda: run() if _State.capture is not None else torch.zeros(
            (batch.q.shape[0], batch.q.shape[1], 512), dtype=torch.bfloat16)

    monkeypatch.setattr(fake_cuda["ours"], "prepare", lying)
    code, rec = _run(tmp_path, "--systems", "ours,sglang-splitkv")
    assert code == 1
    st = {(r["case"], r["system"], r["mask"]): r for r in rec["details"]["results"]}
    assert st[(TINY[0].name, "ours", "tree")]["status"] == "wrong"
    assert st[(TINY[0].name, "sglang-splitkv", "chain")]["status"] == "unsupported"
    assert "not correct" in rec["reason"]


def test_simulated_pass_without_targets(fake_cuda, monkeypatch, tmp_path):
    _suite(monkeypatch, (), systems=("ours",), kind="graph")
    code, rec = _run(tmp_path)
    assert code == 0 and rec["passed"] is True and rec["reason"] is None
    assert "eager" in rec["headline"] and "replay" in rec["headline"]
    assert "| eager / replay |" in rec["details"]["markdown_table"]


def test_simulated_sticky_cuda_fault_ends_the_suite_keeps_figures(fake_cuda, monkeypatch, tmp_path):
    _suite(monkeypatch, (), systems=("ours", "sglang-extend", "sglang-splitkv"))
    fake_cuda["sglang-extend"]._kw["fail"] = True
    monkeypatch.setattr(gate, "_cuda_alive", lambda: "AcceleratorError: CUDA error: an illegal memory access")
    code, rec = _run(tmp_path)
    assert code == 1 and "CUDA context is broken" in rec["reason"]
    st = {(r["case"], r["system"], r["mask"]): r["status"] for r in rec["details"]["results"]}
    assert st[(TINY[0].name, "ours", "tree")] == "ok"  # taken before the fault: kept
    assert st[(TINY[0].name, "sglang-extend", "tree")] == "error"
    assert st[(TINY[0].name, "sglang-splitkv", "chain")] == "error"  # after the fault, same case
    assert {st[k] for k in st if k[0] == TINY[1].name} == {"skipped"}


def test_simulated_budget_exhausted_skips_and_fails(fake_cuda, monkeypatch, tmp_path):
    _suite(monkeypatch, (), systems=("ours",))
    code, rec = _run(tmp_path, "--budget-s", "1e-9")
    assert code == 1 and "budget" in rec["reason"]
    assert {r["status"] for r in rec["details"]["results"]} == {"skipped"}


def test_simulated_other_gpu_targets_not_applicable(fake_cuda, monkeypatch, tmp_path):
    _suite(monkeypatch, ("tree_vs_chain",), systems=("ours",))
    props = torch.cuda.get_device_properties()
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(**{**props.__dict__, "name": "NVIDIA RTX PRO 6000"}))
    code, rec = _run(tmp_path)
    assert code == 1 and "not applicable" in rec["reason"]
    assert rec["metrics"]["targets"]["tree_vs_chain"]["status"] == "n/a"
    assert rec["metrics"]["targets"]["tree_vs_chain"]["measured"] > 0  # timings still recorded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_suite_on_gpu(tmp_path):
    """The real gate, smallest suite (the owned kernel only)."""
    code = gate.main(["--suite", "graph", "--out", str(tmp_path / "o")])
    rec = evidence.load_record(tmp_path / "bench-graph.json")
    assert code == (0 if rec["passed"] else 1)
    assert all(r["status"] == "ok" for r in rec["details"]["results"]), rec["reason"]


def test_case_seed_same_request_across_layouts():
    a, b = Case(1, 16, 8, 4096, layout="contiguous"), Case(1, 16, 8, 4096, layout="runs16")
    assert gate.case_seed(a, 0) == gate.case_seed(b, 0)
    assert gate.case_seed(a, 0) != gate.case_seed(Case(1, 16, 8, 23000), 0)
    assert gate.case_seed(a, 0) != gate.case_seed(a, 1)
    # a uniform case's seed is the one its recorded figures were taken with
    assert gate.case_seed(Case(8, 16, 8, 65536), 2) == 2 * 100_003 + zlib.crc32(b"8-16-8-65536") % 100_000
    # a ragged case: its own data, the same in every layout
    lens = (65536,) + (1024,) * 7
    r, r16 = Case.ragged(16, 8, lens, "one64k-seven1k"), Case.ragged(16, 8, lens, "x", layout="runs16")
    assert gate.case_seed(r, 0) == gate.case_seed(r16, 0) != gate.case_seed(Case(8, 16, 8, 65536), 0)
    assert gate.case_seed(r, 0) != gate.case_seed(Case.ragged(16, 8, lens[::-1]), 0)


def test_simulated_run_hands_every_peer_the_ragged_lengths(fake_cuda, monkeypatch, tmp_path):
    """A ragged case through the gate: every system is prepared on batches with the case's
    per-request lengths, its figures are checked and recorded, and its floor is the ragged one."""
    ragged = Case.ragged(3, 2, (90, 0, 17), "mix")
    _suite(monkeypatch, ("tree_vs_chain",), cases=(TINY[0], ragged))
    fake_cuda["flashmla"]._missing = None
    seen: dict[str, set] = {}
    for name, fake in fake_cuda.items():
        def spy(batch, real=fake.prepare, name=name):
            if len(batch.prefix_lens) == 3:
                seen.setdefault(name, set()).add((tuple(batch.prefix_lens), tuple(batch.kv_indptr.tolist()),
                                                  tuple(batch.qo_indptr.tolist())))
            return real(batch)

        monkeypatch.setattr(fake, "prepare", spy)
    code, rec = _run(tmp_path)
    # (the fake systems' times are this CPU's: on a loaded machine tree_vs_chain may miss, which
    # is not what this test is about; anything else failing is)
    assert code == 0 or (rec["reason"] or "").startswith("tree_vs_chain: FAIL"), rec["reason"]
    assert seen == {s: {((90, 0, 17), (0, 90, 90, 107), (0, 3, 6, 9))} for s in suites.SYSTEMS}
    st = {(r["case"], r["system"], r["mask"]): r["status"] for r in rec["details"]["results"]}
    assert st[(ragged.name, "flashmla", "chain")] == "ok" and st[(ragged.name, "ours", "tree")] == "ok"
    report = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert report["floors"][ragged.name]["bytes"] == roofline.case_bytes(ragged)
    tvc = rec["details"]["targets"][0]
    assert tvc["name"] == "tree_vs_chain" and ragged.name in {r["case"] for r in tvc["rows"]}


def test_sm120_targets_fail_with_the_target_and_the_miss(fake_cuda, monkeypatch, tmp_path):
    """Issue 15's bench gate: the sm_120 emulation's time over the Hopper kernel's (the
    same run, same inputs) is checked per case; a slow emulation fails sm120_hopper and
    the reason names the target, the worst case and by how much it misses."""
    _suite(monkeypatch, ("sm120_hopper", "sm120_seed"), systems=("ours", "ours-sm120"))
    # 20 ms per call against ours' reference-only cost: a ratio far above 2.5 on a loaded machine too
    fake_cuda["ours-sm120"]._kw["delay_s"] = 0.02
    code, rec = _run(tmp_path)
    assert code == 1 and rec["passed"] is False
    t = rec["metrics"]["targets"]
    assert t["sm120_hopper"]["status"] == "fail" and t["sm120_hopper"]["measured"] > 2.5
    assert t["sm120_hopper"]["worst_case"] in {c.name for c in TINY}
    assert "sm120_hopper: FAIL" in rec["reason"] and "misses by" in rec["reason"]
    # no bs=1 N=16 H=8 case at 23k..91k in the tiny suite: the seed target has nothing to check
    assert t["sm120_seed"]["status"] == "unmeasured"
    sm = rec["details"]["markdown_table"]
    assert "sm_120 emulation" in sm and "sm_120 / Hopper" in sm and "no sm_120 GPU is available here" in sm


def test_sm120_targets_pass_when_the_emulation_keeps_up(fake_cuda, monkeypatch, tmp_path):
    _suite(monkeypatch, ("sm120_hopper",), systems=("ours", "ours-sm120"))
    fake_cuda["ours"]._kw["delay_s"] = 0.002
    fake_cuda["ours-sm120"]._kw["delay_s"] = 0.002
    code, rec = _run(tmp_path)
    t = rec["metrics"]["targets"]["sm120_hopper"]
    assert t["status"] == "pass" and 0.5 < t["measured"] <= 2.5, t
    assert code == 0


# ----------------------------------------------------------------------------- side-by-side timing


class _LoggedGraph:
    """A captured graph whose replays log their name and take ``ms``: of host time, or, with
    ``clock`` (a one-element list of milliseconds that the fake events read), of that clock, so
    that a timing assertion does not depend on how long a sleep takes on a loaded machine."""

    def __init__(self, name, ms, log, fail_at=None, clock=None):
        self.name, self.ms, self.log, self.fail_at, self.clock = name, ms, log, fail_at, clock

    def replay(self):
        if self.fail_at is not None and len(self.log) >= self.fail_at:
            raise RuntimeError("simulated replay fault")
        self.log.append(self.name)
        if self.clock is not None:
            self.clock[0] += self.ms
        else:
            time.sleep(self.ms / 1e3)


def _prepared(name, ms, log, **kw):
    from kdtree_pipeline.bench import timing

    return timing.Prepared([lambda: None], timing.Measurement(calls=2), _LoggedGraph(name, ms, log, **kw))


def test_side_by_side_replays_interleave_in_alternating_order(fake_cuda, monkeypatch):
    """Each set keeps its own repetition count, and the rounds go forward then backward, so no
    set is timed only right after one other: the tree/chain and sm_120/Hopper ratios do not
    depend on which was timed first. The replays advance a fake clock that the events read
    (real sleeps overshot 1 ms by 3 on a loaded 2-core machine, and a's count fell to c's)."""
    from kdtree_pipeline.bench import timing

    clock = [0.0]  # ms, in whole steps: exact in floating point
    monkeypatch.setattr(_Event, "record", lambda self, stream=None: setattr(self, "t", clock[0]))
    monkeypatch.setattr(_Event, "elapsed_time", lambda self, other: other.t - self.t)
    log: list[str] = []
    a, b, c = (_prepared(n, ms, log, clock=clock) for n, ms in (("a", 1.0), ("b", 1.0), ("c", 4.0)))
    timing.time_replays([a, b, c], budget_s=0.012, min_reps=3, max_reps=100)
    est, rounds = log[:3], log[3:]
    assert est == ["a", "b", "c"]  # one replay each sizes its repetitions
    assert rounds[:6] == ["a", "b", "c", "c", "b", "a"]
    # c (4 ms) gets 3 reps of the 12 ms budget, a and b (1 ms) 12 each; the figure is per call
    assert a.m.replay_reps == rounds.count("a") and c.m.replay_reps == rounds.count("c")
    assert (c.m.replay_reps, a.m.replay_reps, b.m.replay_reps) == (3, 12, 12)
    assert c.m.replay_us == pytest.approx(2000) and a.m.replay_us == pytest.approx(500)  # ms / 2 calls
    assert len(a.m.samples["replay_ms"]) == a.m.replay_reps and a.timed and c.timed


def test_a_replay_fault_leaves_every_set_without_a_graph_figure(fake_cuda):
    from kdtree_pipeline.bench import timing

    log: list[str] = []
    a, b = _prepared("a", 0.5, log), _prepared("b", 0.5, log, fail_at=5)
    timing.time_replays([a, b], budget_s=0.01)
    for p in (a, b):
        assert p.m.replay_us is None and "simulated replay fault" in p.m.graph_error and p.graph is None


def _replay_groups(monkeypatch) -> list[int]:
    """The size of each group of replays timing.time_replays is given, appended as it is called."""
    from kdtree_pipeline.bench import timing

    groups: list[int] = []
    real = timing.time_replays

    def spy(preps, **kw):
        groups.append(len([p for p in preps if p.graph is not None]))
        return real(preps, **kw)

    monkeypatch.setattr(timing, "time_replays", spy)
    return groups


def test_side_by_side_figures_are_recorded_with_the_rest(fake_cuda, monkeypatch, tmp_path):
    """Through the gate: the owned kernel's systems' replays are timed together (each still checked
    against the reference, eager figures kept) and the peers after them, each alone."""
    _suite(monkeypatch, (), systems=("ours", "ours-sm120", "sglang-extend", "flashmla"))
    fake_cuda["flashmla"]._missing = None  # importable here: a peer, timed alone like SGLang's
    groups = _replay_groups(monkeypatch)
    code, rec = _run(tmp_path)
    # per case: one group of the owned kernel's four sets, then the peers' (extend tree and
    # chain, FlashMLA chain), each alone
    assert groups == [4, 1, 1, 1] * len(TINY), groups
    rows = [r for r in rec["details"]["results"] if r["case"] == TINY[0].name]
    assert [(r["system"], r["mask"]) for r in rows] == [
        ("ours", "tree"), ("ours", "chain"), ("ours-sm120", "tree"), ("ours-sm120", "chain"),
        ("sglang-extend", "tree"), ("sglang-extend", "chain"), ("flashmla", "chain")]
    for r in rows:
        assert r["status"] == "ok" and r["replay_us"] > 0 and r["eager_us"] > 0 and r["replay_reps"] >= 3, r


@pytest.mark.parametrize("together,groups", [
    ((), [1, 1, 1, 1]),  # every system alone, one after another
    (("ours",), [2, 1, 1]),  # ours' two masks interleaved, the emulation alone after them
])
def test_run_case_times_the_group_it_is_given(fake_cuda, monkeypatch, together, groups):
    """run_case's side_by_side names the interleaved group (an A/B caller passes its own);
    the module's default group is left as it was."""
    from kdtree_pipeline.bench import gate

    default = gate.SIDE_BY_SIDE
    seen = _replay_groups(monkeypatch)
    systems = ("ours", "ours-sm120")
    out: list = []
    gate.run_case(TINY[0], systems, {s: fake_cuda[s] for s in systems}, {}, 200_000, 0, out, side_by_side=together)
    assert seen == groups
    assert [(r.system, r.mask, r.status) for r in out] == [
        ("ours", "tree", "ok"), ("ours", "chain", "ok"), ("ours-sm120", "tree", "ok"), ("ours-sm120", "chain", "ok")]
    assert gate.SIDE_BY_SIDE == default


def test_a_fatal_fault_while_flushing_marks_the_waiting_side_by_side_runs_not_timed(fake_cuda, monkeypatch):
    """A sticky fault found while the side-by-side systems' eager figures are taken ends the case:
    the run that failed is recorded with its own error, every run still waiting says it was not
    timed, none is recorded twice, no graph is kept, and no peer is started."""
    from kdtree_pipeline.bench import timing

    prepared: list[timing.Prepared] = []
    real_prepare = timing.prepare

    def spy(*a, **kw):
        prepared.append(real_prepare(*a, **kw))
        return prepared[-1]

    def eager_fault(p, **kw):
        raise RuntimeError("simulated eager fault")

    monkeypatch.setattr(timing, "prepare", spy)
    monkeypatch.setattr(timing, "time_eager", eager_fault)
    monkeypatch.setattr(gate, "_cuda_alive", lambda: "AcceleratorError: CUDA error: an illegal memory access")
    systems = ("ours", "ours-sm120", "sglang-extend")
    out: list = []
    with pytest.raises(RuntimeError, match="CUDA context is broken after ours"):
        gate.run_case(TINY[0], systems, {s: fake_cuda[s] for s in systems}, {}, 200_000, 0, out)
    assert [(r.system, r.mask, r.status) for r in out] == [
        ("ours", "tree", "error"), ("ours", "chain", "error"),
        ("ours-sm120", "tree", "error"), ("ours-sm120", "chain", "error")]
    assert "simulated eager fault" in out[0].error
    assert all(r.error.startswith("not timed: the case ended early") for r in out[1:])
    assert len(prepared) == 4 and all(p.timed and p.graph is None for p in prepared)
