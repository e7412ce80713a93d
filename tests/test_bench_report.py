"""Report rendering: JSON (strict), markdown tables, PNG plots, no matplotlib."""

from __future__ import annotations

import builtins
import json

import pytest

from kdtree_pipeline.bench import report
from kdtree_pipeline.bench.results import Result, Table
from kdtree_pipeline.bench.roofline import Ceilings, floor_terms
from kdtree_pipeline.bench.suites import SUITES, Case, Suite
from kdtree_pipeline.bench.targets import evaluate

CASES = (Case(1, 16, 8, 23000), Case(1, 16, 8, 65536), Case(1, 64, 8, 65536))
SUITE = Suite("lc-test", "a test suite", CASES, ("ours", "sglang-extend", "sglang-splitkv", "flashmla"),
              ("flashmla", "splitkv"), budget_s=10)
CEIL = Ceilings(4.27e12, 790e12)


def _results() -> list[Result]:
    rs = []
    for i, c in enumerate(CASES):
        rs += [Result(c.name, "ours", "tree", "ok", replay_us=30.0 + i, eager_us=60.0 + i),
               Result(c.name, "ours", "chain", "ok", replay_us=28.0 + i, eager_us=58.0 + i),
               Result(c.name, "sglang-extend", "tree", "ok", replay_us=4000.0 * (i + 1), eager_us=4010.0),
               Result(c.name, "flashmla", "chain", "missing", error="ModuleNotFoundError: No module named 'flash_mla'")]
    rs.append(Result(CASES[0].name, "sglang-splitkv", "chain", "ok", replay_us=None, eager_us=230.0,
                     graph_error="RuntimeError: operation not permitted when stream is capturing"))
    rs.append(Result(CASES[1].name, "sglang-splitkv", "chain", "wrong", replay_us=400.0, eager_us=410.0,
                     check={"passed": False, "max_abs": float("inf"), "cos_diff": float("nan")}))
    rs.append(Result(CASES[2].name, "sglang-splitkv", "chain", "error", error="OutOfResources: shared memory"))
    return rs


def _report(suite=SUITE, results=None):
    results = results if results is not None else _results()
    floors = {c.name: floor_terms(c, CEIL) for c in suite.cases}
    ts = evaluate(suite.targets, suite.cases, Table(results), {k: v["floor_us"] for k, v in floors.items()},
                  "NVIDIA H200")
    return report.build(suite, suite.cases, results, floors, CEIL.as_dict(), ts,
                        {"flashmla": "ModuleNotFoundError: No module named 'flash_mla'"}, suite.systems,
                        meta={"gpu": "NVIDIA H200"})


def test_markdown_table_columns_and_cells():
    rep = _report()
    md = report.main_table(rep)
    lines = md.splitlines()
    assert lines[0] == ("| case | ours tree | ours chain | SGLang extend | SGLang split-KV | FlashMLA | floor "
                        "| ours/FlashMLA | floor/ours |")
    assert len(lines) == 2 + len(CASES)
    row0 = lines[2].split(" | ")
    assert row0[1] == "30" and row0[2] == "28" and row0[3] == "4000"
    assert "230 (eager)" in lines[2] and "missing" in lines[2]
    assert "WRONG 400" in lines[3] and "| error |" in lines[4]
    fl = floor_terms(CASES[1], CEIL)["floor_us"]
    assert lines[3].rstrip(" |").endswith(f"{fl / 31.0:.2f}")  # floor / ours tree
    eager = report.compare_table(rep, eager=True).splitlines()
    assert eager[2].split(" | ")[1] == "60"


def test_markdown_document_lists_targets_and_notes():
    md = report.markdown(_report())
    assert "Targets:" in md and "flashmla: UNMEASURED" in md
    assert "not capturable in a CUDA graph" in md and "OutOfResources" in md
    assert "flash_mla" in md


def test_write_json_markdown_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    files = report.write(_report(), tmp_path)
    data = json.loads(files["json"].read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert data["suite"] == "lc-test" and len(data["results"]) == len(_results())
    bad = next(r for r in data["results"] if r["status"] == "wrong")
    assert bad["check"]["max_abs"] == "inf"
    assert {p.name for p in files["png"]} == {"lc-test-time.png", "lc-test-speedup.png"}
    for p in files["png"]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert files["markdown"].read_text().startswith("### Bench `lc-test`")


def test_without_matplotlib_json_and_markdown_still_written(tmp_path, monkeypatch):
    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    files = report.write(_report(), tmp_path)
    assert files["png"] == [] and "matplotlib is not available" in files["notes"][0]
    assert files["json"].exists() and "matplotlib is not available" in files["markdown"].read_text()
    assert not list(tmp_path.glob("*.png"))


def test_no_peer_figures_no_speedup_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rs = [r for r in _results() if r.system not in ("sglang-extend", "flashmla")]
    files = report.write(_report(results=rs), tmp_path)
    assert [p.name for p in files["png"]] == ["lc-test-time.png"]
    assert any("no SGLang extend or FlashMLA figures" in n for n in files["notes"])


def test_every_plotted_value_sits_over_its_case_name(tmp_path, monkeypatch):
    """One bar group per case, the case names on the x axis, each bar labelled."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    rep = _report()
    names, times, speed = report._plot_series(rep)
    assert names == [c["name"] for c in rep["cases"]]
    t = report._results(rep)
    for i, name in enumerate(names):
        assert times["ours tree"][i] == t.time(name, "ours", "tree")
        ext, tree = t.time(name, "sglang-extend", "tree"), t.time(name, "ours", "tree")
        if ext and tree:
            assert speed["SGLang extend / ours tree"][i] == pytest.approx(ext / tree)
    seen = []
    real = Figure.savefig

    def capture(fig, path, *a, **k):
        ax = fig.axes[0]
        seen.append(([x.get_text() for x in ax.get_xticklabels()],
                     [x.get_text() for x in ax.get_legend().get_texts()],
                     sum(len(c.datavalues) for c in ax.containers)))
        return real(fig, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", capture)
    report.write(rep, tmp_path)
    (ticks, legend, bars), (sticks, slegend, _) = seen
    assert ticks == names and sticks == names
    assert set(times) <= set(legend) and "SGLang extend / ours tree" in slegend
    assert bars == sum(v is not None for vs in times.values() for v in vs)


def test_fragmentation_and_graph_tables():
    fr = SUITES["fragmentation"]
    cases = [c for c in fr.cases if c.prefix == 4096]
    rs = []
    for c in cases:
        slow = 1.0 if c.layout == "contiguous" else 1.2
        rs += [Result(c.name, "ours", "tree", "ok", replay_us=10.0 * slow, eager_us=30.0),
               Result(c.name, "sglang-extend", "tree", "ok", replay_us=700.0 * slow, eager_us=700.0)]
    sub = Suite("fragmentation", fr.description, tuple(cases), fr.systems, fr.targets, 10, kind="fragmentation")
    md = report.main_table(_report(sub, rs))
    assert md.splitlines()[0].startswith("| prefix | layout | ours tree | ours penalty")
    frag_line = next(line for line in md.splitlines() if "| fragmented |" in line)
    assert frag_line.count("+20.0%") == 2
    gr = SUITES["graph"]
    rs = [Result(c.name, "ours", "tree", "ok", replay_us=10.0, eager_us=45.0) for c in gr.cases]
    md = report.main_table(_report(gr, rs))
    assert "| 45 | 10 | 4.50 | 35 |" in md


def test_rerender_from_json(tmp_path, capsys):
    files = report.write(_report(), tmp_path / "a")
    assert report.main([str(files["json"]), "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "lc-test.md").read_text() == files["markdown"].read_text()
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    assert report.main([str(bad)]) == 2
    assert "expected a bench report JSON" in capsys.readouterr().err


RAGGED = Case.ragged(16, 8, (65536,) + (1024,) * 7, "one64k-seven1k")


def _ragged_report():
    cases = (CASES[0], RAGGED)
    suite = Suite("ragged-test", "uniform and ragged", cases, SUITE.systems, ("flashmla", "tree_vs_chain"), 10)
    rs = []
    for i, c in enumerate(cases):
        rs += [Result(c.name, "ours", "tree", "ok", replay_us=60.0 + i, eager_us=90.0),
               Result(c.name, "ours", "chain", "ok", replay_us=59.0 + i, eager_us=88.0),
               Result(c.name, "sglang-extend", "tree", "ok", replay_us=10000.0, eager_us=10010.0),
               Result(c.name, "flashmla", "chain", "ok", replay_us=54.0, eager_us=70.0)]
    return _report(suite, rs)


def test_ragged_case_in_the_report_json_tables_and_plots(tmp_path):
    rep = _ragged_report()
    case = next(c for c in rep["cases"] if c["name"] == RAGGED.name)
    assert case["prefix"] == 65536 and case["prefixes"] == [65536] + [1024] * 7
    assert case["label"] == "one64k-seven1k" and case["series"] == "bs8 N16 H8 ragged one64k-seven1k"
    assert next(c for c in rep["cases"] if c["name"] == CASES[0].name)["prefixes"] is None
    fl = floor_terms(RAGGED, CEIL)["floor_us"]
    assert rep["floors"][RAGGED.name]["floor_us"] == fl
    row = next(line for line in report.main_table(rep).splitlines() if line.startswith(f"| {RAGGED.name} |"))
    cells = row.strip("| ").split(" | ")
    assert cells[1:3] == ["61", "60"] and cells[5] == "54" and cells[-3:] == [report._us(fl), "1.11", f"{fl / 61:.2f}"]
    md = report.markdown(rep)
    assert f"- {RAGGED.name}: 1 x 65536, 7 x 1024" in md and "Ragged cases" in md
    assert f"- {CASES[0].name}:" not in md  # a uniform case is not listed as ragged
    targets = {t["name"]: t for t in rep["targets"]}
    assert RAGGED.name in {r["case"] for r in targets["flashmla"]["rows"]}
    names, times, speed = report._plot_series(rep)
    assert names == [CASES[0].name, RAGGED.name]
    assert times["FlashMLA"][1] == 54.0 and speed["FlashMLA / ours chain"][1] == pytest.approx(54 / 60)
    assert times["floor"][1] == fl
    files = report.write(rep, tmp_path / "a")  # and back from its JSON, as on a machine with matplotlib
    assert report.main([str(files["json"]), "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "ragged-test.md").read_text() == files["markdown"].read_text()


def test_report_from_before_ragged_cases_still_renders():
    """A report JSON written before Case.prefixes existed has no prefixes or label: uniform."""
    rep = _report()
    for c in rep["cases"]:
        del c["prefixes"], c["label"]
    assert report.main_table(rep) == report.main_table(_report())
    assert "Ragged cases" not in report.markdown(rep)
    assert report.prefix_text(rep["cases"][0]) == "23000"


def test_fragmentation_table_pairs_a_ragged_layout_with_its_own_lengths():
    """The penalty of a ragged case's layout is taken against the contiguous case of the same
    lengths, not against a uniform case that shares bs, N, H and the longest prefix."""
    lens = (300, 10, 10)
    uni = Case(3, 4, 2, 300, layout="contiguous", masks=("tree",))
    rag0, rag = (Case.ragged(4, 2, lens, "one300", layout=lay, masks=("tree",)) for lay in ("contiguous", "fragmented"))
    cases = (rag0, uni, rag)
    rs = [Result(c.name, "ours", "tree", "ok", replay_us=us, eager_us=us) for c, us in ((rag0, 10.0), (uni, 30.0),
                                                                                         (rag, 11.0))]
    fr = SUITES["fragmentation"]
    md = report.main_table(_report(Suite("fragmentation", fr.description, cases, ("ours",), (), 10,
                                         kind="fragmentation"), rs))
    line = next(x for x in md.splitlines() if "| fragmented |" in x)
    assert line.startswith("| 1 x 300, 2 x 10 | fragmented | 11 | +10.0% |")
    assert "| 300 | contiguous | 30 | +0.0% |" in md
