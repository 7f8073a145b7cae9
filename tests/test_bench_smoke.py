"""A quick run of the benchmark suite, so it cannot rot (benchmarks assert no speed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


@pytest.mark.slow
@pytest.mark.timeout(900)  # every bench at its smoke size, one after another (the default 300 s is a test's)
def test_benchmark_suite_runs_at_smoke_sizes(tmp_path):
    out = tmp_path / "BENCH.md"
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)], capture_output=True, cwd=ROOT,
                          text=True, timeout=840, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for title in ("Saturation", "Cost", "Producer", "Export", "Longest first", "Client CPU", "2b. Consumer CPU",
                  "Fleet end of run", "Prefix-cache locality", "Pack cache",
                  "Producer by reference, packs on S3", "What a consumer sends Redis a second",
                  "Log-probability tables (--logprobs K)", "Hidden-state capture (--capture)"):
        assert title in text, title
    assert "FAILED" not in text
