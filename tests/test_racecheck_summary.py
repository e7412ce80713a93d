"""tools/racecheck_summary.py, which condenses compute-sanitizer racecheck reports for the
racecheck step of tools/gpu_session.sh (issue 16): it reads both report formats (CPU)."""

from __future__ import annotations

from conftest import load_tool

rs = load_tool("racecheck_summary")

# the two thread-line layouts compute-sanitizer has printed (kernel+offset in file:line, and
# offset in file:line:kernel), an analysis record, and the summary line
REPORT = """\
========= COMPUTE-SANITIZER
========= Warning: Potential RAW hazard detected at __shared__ 0x100 in block (1,0,0) :
=========     Write Thread (128,0,0) at void k<0>(Config, int *)+0x1340 in racecheck_min.cu:250
=========     Read Thread (3,0,0) at void k<0>(Config, int *)+0x1b90 in racecheck_min.cu:270
=========     Current Value : 0, Incoming Value : 0
========= Warning: Potential RAW hazard detected at __shared__ 0x101 in block (0,0,0) :
=========     Write Thread (129,0,0) at 0x1340 in /x/tools/racecheck_min.cu:250:void k<0>(Config, int *)
=========     Read Thread (2,0,0) at 0x1b90 in /x/tools/racecheck_min.cu:270:void k<0>(Config, int *)
========= Error: Potential WAR hazard detected at __shared__ 0x0 in block (0,0,0) :
=========     Read Thread (130,0,0) at 0x560 in racecheck_min.cu:231:void k<0>(Config, int *)
=========     Write Thread (0,0,0) at 0x1300 in racecheck_min.cu:250:void k<0>(Config, int *)
========= Warning: Race reported between Write access at void k<0>(Config, int *)+0x1340 in racecheck_min.cu:250
=========     and Read access at void k<0>(Config, int *)+0x1b90 in racecheck_min.cu:270 [512 hazards]
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""


def test_groups_hazards_by_direction_lines_and_warpgroups():
    out = rs.summarize(REPORT)
    assert out[0] == "RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)"
    assert "race (WARNING): Write racecheck_min.cu:250 / Read racecheck_min.cu:270 [512 hazards]" in out[1]
    raw = [ln for ln in out if "hazard RAW" in ln]
    assert raw == ["  hazard RAW (WARNING) x2: Write racecheck_min.cu:250 (wg 1) -> Read racecheck_min.cu:270 (wg 0);"
                   " blocks 2: (0,0,0) (1,0,0)"]
    war = [ln for ln in out if "hazard WAR" in ln]
    assert war and "Read racecheck_min.cu:231 (wg 1) -> Write racecheck_min.cu:250 (wg 0)" in war[0]


def test_a_clean_report_and_a_cut_off_one():
    assert rs.summarize("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n") == [
        "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"]
    assert rs.summarize("racecheck_min: handoff=arrive\n")[0].startswith("no RACECHECK SUMMARY line")
