"""One public face: what a user needs comes from ``tagc_hook``; one version, one license."""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import tagc
import tagc_hook

ROOT = Path(__file__).resolve().parents[1]


def test_everything_a_user_calls_is_importable_from_tagc_hook() -> None:
    """The README and the docs import only ``tagc_hook``: the config, the presets, the
    wrapping helpers, register and its state (stats, checkpoints), the pipeline stage
    and the exit drain are all there, and ``__all__`` lists exactly what exists."""
    needed = {"TAGCConfig", "TAGCState", "register", "shard_model", "fsdp1_auto_wrap_policy",
              "pipeline_stage", "PipelineConfig", "presets", "teardown", "__version__"}
    assert needed <= set(tagc_hook.__all__)
    assert [n for n in tagc_hook.__all__ if not hasattr(tagc_hook, n)] == []
    assert callable(tagc_hook.teardown.install) and "tagc-full" in tagc_hook.presets.names()
    for method in ("stats", "memory", "exact_gathers", "state_dict", "load_state_dict",
                   "check_dcp", "load_dcp"):
        assert callable(getattr(tagc_hook.TAGCState, method)), method


def test_docs_import_the_public_face_only() -> None:
    """No user-facing page has a user's program import from the implementation package
    (a maintainer's one-liner that regenerates a doc may name a module)."""
    pages = [ROOT / "README.md", ROOT / "docs" / "USAGE.md"]
    hits = [f"{p.name}: {line.strip()}" for p in pages
            for line in p.read_text().splitlines()
            if re.search(r"\bfrom tagc(\.\w+)* import\b", line)]
    assert hits == [], hits


def test_one_version() -> None:
    """``tagc.__version__`` is the release, the same the installed metadata carries
    (setup.py reads the constant), and ``tagc_hook`` shows the same."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", tagc.__version__)
    assert tagc_hook.__version__ == tagc.__version__
    try:
        installed = importlib.metadata.version("tagc")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tagc is not installed (only its checkout is on the path)")
    assert installed == tagc.__version__


def test_license_and_changelog() -> None:
    """BSD-3-Clause, named the same in LICENSE and setup.py; the changelog has a section
    for the current version."""
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "the TAGC authors" in text
    assert 'license="BSD-3-Clause"' in (ROOT / "setup.py").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {tagc.__version__}" in changelog
