"""The feature-size benchmark runs (so it cannot rot) and prints the figures BENCHMARKS.md quotes."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_the_bench_prints_sizes_projection_and_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.bench_features", "--quick"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any(re.match(r"27B \(hidden 5120\)\s+4\s+20,492\s+40,968$", line) for line in lines)
    assert any(re.match(r"tiny \(hidden 128\)\s+3\s+396\s+776$", line) for line in lines)
    big = next(line for line in lines if line.startswith("27B (hidden 5120), 4 layers  fp8_e4m3"))
    assert "40.98 TB" in big
    errors = [float(m[1]) for line in lines if (m := re.search(r"\s(0\.\d{4}) \(bound 1/17", line))]
    assert len(errors) == 4 and all(0.05 < e <= 0.0589 for e in errors)
