"""bench/omni_serving.py's ``--repeats``: the smoke (CPU, a tiny config) with two repeats
keeps both runs of every level and a summary whose medians lie within the runs' ranges."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "omni_serving.py"


def test_smoke_with_two_repeats_keeps_both_runs_and_a_summary(tmp_path):
    out = tmp_path / "omni_serving.json"
    done = subprocess.run([sys.executable, str(_SCRIPT), "--smoke", "--repeats", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = result["levels"]
    runs = Counter((row["streams"], row["arm"]) for row in rows)
    assert runs and set(runs.values()) == {2}, runs
    # interleaved: every level's repeat 0 before any level's repeat 1
    assert [row["repeat"] for row in rows] == [0] * len(runs) + [1] * len(runs)
    # each run printed as its own JSON line, then the summary's table
    assert sum(1 for line in done.stdout.splitlines() if line.startswith('{"arm"')) == len(rows)
    assert "median [min-max]" in done.stdout
    summary = result["summary"]
    assert {(e["streams"], e["arm"]) for e in summary} == set(runs)
    for entry in summary:
        assert entry["runs"] == 2
        mine = [row for row in rows if (row["streams"], row["arm"]) == (entry["streams"], entry["arm"])]
        for key in ("ttfp_p50_ms", "rtf_p50", "audio_s_per_s", "c100", "underruns", "worst_gap_p50_ms"):
            figure = entry[key]
            assert figure is not None, key
            values = [row[key] for row in mine]
            assert figure["min"] == min(values) and figure["max"] == max(values), (key, figure, values)
            assert figure["min"] <= figure["median"] <= figure["max"], (key, figure)
