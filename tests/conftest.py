"""Shared test setup: markers, and visible skips for missing pieces.

Imports: ``tagc``, ``tagc_hook`` and ``tagc.train`` from the installed project (or the
checkout, first on the path under ``python -m pytest``); the helper modules beside
this file (pytest puts tests/ on the path); a script of ``scripts/`` through
``script_helpers.load_script``.

Markers (registered in setup.cfg):
  slow   multi-process suites beyond N=2, process restarts, builds; the fast tier is
         ``pytest -m "not slow"``
  dist   spawns several gloo processes on 127.0.0.1
  codec  needs the ``_tagc`` C extension: skipped, with the reason, without a build
  cuda   needs a CUDA GPU and a CUDA build of ``_tagc`` (tests/cuda_helpers.py)
  bench  a codec benchmark (tests/test_bench_codec.py; timed only with --benchmark-enable)
"""
from __future__ import annotations

from typing import List, Optional

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--bench-size", default=str(1 << 20),
                     help="shard length (fp32 entries) of tests/test_bench_codec.py")


def codec_missing() -> Optional[str]:
    """Why the ``_tagc`` codec cannot be imported, or None when it can."""
    try:
        import _tagc  # noqa: F401
    except ImportError as exc:
        return f"the _tagc codec is not built (pip install -e .): {exc}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    why = codec_missing()
    if why is None:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if item.get_closest_marker("codec") is not None:
            item.add_marker(skip)
