"""bench/dense_step.py runs as documented on the CPU: the engine's dense call, step by step,
beside the static reference, each way's row in its table."""

from __future__ import annotations

import re
import subprocess
import sys


def test_each_way_gets_a_row_of_times_against_the_static_reference(tmp_path):
    ways = ["static", "as shipped", "decode"]
    args = ["--random-model", "llama-tiny", "--device", "cpu", "--particles", "4", "--steps", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.dense_step", *args, "--repeats", "1", "--ways", *ways],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # the last column, over the bandwidth floor, is measured on CUDA only
    rows = re.findall(r"^\| 4 \| ([a-z ]+) \| ([\d.]+) \|.*\| ([\d.]+) \| – \|$", done.stdout, re.MULTILINE)
    assert [way for way, _, _ in rows] == ways
    assert all(float(ms) > 0 for _, ms, _ in rows) and rows[0][2] == "1.00"
