"""tools/clock_probe.py (docs/kernel-notes.md, entry AE1): its readings' windows and the
arguments it refuses before it spends GPU time (CPU)."""

from __future__ import annotations

import pytest

from conftest import load_tool

cp = load_tool("clock_probe")


def test_a_window_takes_the_readings_stamped_inside_it():
    s = cp.Sampler(cp.QUERY)
    s.rows = [(1.0, [1980.0, 300.0, 40.0]), (2.0, [1600.0, 700.0, 60.0]), (3.0, [1590.0, 705.0, 61.0]),
              (4.5, [1980.0, 200.0, 50.0])]
    assert s.window(1.5, 3.0) == [[1600.0, 700.0, 60.0], [1590.0, 705.0, 61.0]]
    assert s.window(5.0, 6.0) == []


def test_a_window_row_gives_the_cycles_a_call_took_at_its_median_clock():
    row = cp.window_row("ours/chain", 1, 155.0, 143.7, 1.2, [[1500.0, 700.0, 60.0], [1560.0, 720.0, 62.0],
                                                            [1600.0, 690.0, 61.0]])
    assert (row["sm_mhz"], row["power_w"], row["temp_c"], row["readings"]) == (1560.0, 700.0, 61.0, 3)
    assert row["kcycles"] == pytest.approx(155.0 * 1560.0 / 1e3)
    empty = cp.window_row("ours/chain", 0, 155.0, None, 1.2, [])  # no reading inside the window
    assert empty["readings"] == 0 and empty["kcycles"] != empty["kcycles"]  # nan, not a made-up clock


@pytest.mark.parametrize("argv, says", [
    (["--cases", "no-such-case"], "--cases: not in suite micro: no-such-case"),
    (["--cases", "bs8-N16-H8-L32768", "--systems", "ours,nobody"], "--systems: unknown nobody"),
    (["--cases", "bs8-N16-H8-L32768", "--seconds", "0"], "--seconds > 0 and --rounds >= 1 expected, got 0.0, 2"),
    (["--cases", "bs8-N16-H8-L32768", "--rounds", "0"], "--seconds > 0 and --rounds >= 1 expected, got 1.5, 0"),
    (["--cases", "bs8-N16-H8-L32768", "--layout", "sideways"], "--layout: expected one of"),
])
def test_bad_arguments_are_refused_by_name(argv, says, capsys):
    assert cp.main(argv) == 2
    assert says in capsys.readouterr().err


def test_without_nvidia_smi_the_probe_says_so(monkeypatch, capsys):
    def no_smi(self):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(cp.Sampler, "read", no_smi)
    assert cp.main(["--cases", "bs8-N16-H8-L32768"]) == 2
    assert "nvidia-smi cannot be read" in capsys.readouterr().err
