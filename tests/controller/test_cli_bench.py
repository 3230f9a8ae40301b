"""`vigil bench NAME`: every benchmark the CLI names runs as its own process and answers (here: --help).

A benchmark module without its ``__main__`` entry would exit 0 having done nothing (seen once:
`vigil bench comm` printed nothing); this runs each for real, in a subprocess, as the CLI does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ops.cli import BENCHMARKS


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_runs_as_a_module(name: str) -> None:
    r = subprocess.run([sys.executable, "-m", "ops.cli", "bench", name, "--help"], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout and "--json" in r.stdout, (r.stdout, r.stderr)


def test_unknown_benchmark_is_refused() -> None:
    r = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "nope"], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 2 and "unknown benchmark 'nope'" in r.stderr


def test_every_benchmark_is_named_in_the_help() -> None:
    """`vigil --help` lists the benchmarks `vigil bench` knows (chaos among them, issue 14)."""
    from ops.cli import build_parser

    assert BENCHMARKS["chaos"] == "ops.bench.chaos"
    help_text = " ".join(build_parser().format_help().split())
    listed = help_text[help_text.index("Benchmarks ("):].split(")")[0]
    assert sorted(x.strip() for x in listed.removeprefix("Benchmarks (").split(",")) == sorted(BENCHMARKS)
