"""Shared test setup: markers, and visible skips for missing pieces.

Imports: ``tagc``, ``tagc_hook`` and ``tagc.train`` from the installed project (or the
checkout, first on the path under ``python -m pytest``); the helper modules beside
this file (pytest puts tests/ on the path); a script of ``scripts/`` through
``script_helpers.load_script``; the scripts' helpers ``tagc_bench`` (checkout code, not
in the wheel) from ``scripts/bench/``, which this file puts on the path.

Markers (registered in setup.cfg):
  slow   multi-process suites beyond N=2, process restarts, builds; the fast tier is
         ``pytest -m "not slow"``
  dist   spawns several gloo processes on 127.0.0.1
  codec  needs the ``_tagc`` C extension: skipped, with the reason, without a build;
         under ``CI=true`` a missing or unimportable ``_tagc`` fails the run instead
         (a broken build must not pass as a run of skips)

The run ends with the skips counted by reason.
  cuda   needs a CUDA GPU and a CUDA build of ``_tagc`` (tests/cuda_helpers.py)
  bench  a codec benchmark (tests/test_bench_codec.py; timed only with --benchmark-enable)
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import List, Optional

import pytest

# the scripts' helpers (scripts/bench/tagc_bench), importable as the scripts import them
BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"
if BENCH.is_dir() and str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


@pytest.fixture(scope="session")
def cuda_emu_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CUDA launchers compiled by g++ against the emulation (``tagc_bench.cuda_emu``),
    built once per session: each module that runs them loads this file (a build takes
    seconds on 2 cores and is the same for every module).  Skips without a C++ compiler;
    a failed build fails."""
    from tagc_bench import cuda_emu

    try:
        return cuda_emu.build(tmp_path_factory.mktemp("cuda_emu"))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    except cuda_emu.BuildError as exc:
        pytest.fail(str(exc))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--bench-size", default=str(1 << 20),
                     help="shard length (fp32 entries) of tests/test_bench_codec.py")


def codec_missing() -> Optional[str]:
    """Why the ``_tagc`` codec cannot be imported, or None when it can."""
    try:
        import _tagc  # noqa: F401
    except ImportError as exc:
        return f"cannot import the _tagc codec (build it: pip install -e .): {exc}"
    return None


def in_ci() -> bool:
    """Whether this run is CI's (``CI=true``, as .ci/run and most CI services set)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_configure(config: pytest.Config) -> None:
    """Under CI, refuse to run without the codec: every test that needs it (the
    ``codec`` marker, and the modules that ``importorskip`` it) would be skipped and a
    broken build would pass as a green run."""
    why = codec_missing() if in_ci() else None
    if why is not None:
        raise pytest.UsageError(f"CI=true: {why}")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    why = codec_missing()
    if why is None:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if item.get_closest_marker("codec") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The skips counted by reason, so a run that skipped a whole tier says so."""
    reasons: Counter = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section("skips by reason")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"{n:5d}  {reason}")
