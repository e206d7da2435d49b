"""The tests' access to the scripts of ``scripts/`` (programs, not a package).

The code the scripts share lives in the package (``tagc.train``, ``tagc.cost``) or, where
it needs a checkout, in ``scripts/bench/tagc_bench`` (on the path through conftest.py);
the tests of a script's own logic (tables, reports, bookkeeping) load that script by its
path with :func:`load_script`, as ``python scripts/.../NAME.py`` would.  Scripts sit in ``scripts/`` (the entry points a user
runs) or one level below (``bench/``, ``research/``, ``tools/``); a name is found in
either.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def script_path(name: str) -> Path:
    """The file of script ``name``: ``scripts/<name>.py`` or ``scripts/<folder>/<name>.py``.

    Args:
        name: the script's file name without ``.py`` (``"cost_model"``), or its path
            under ``scripts/`` (``"bench/cost_model"``).
    Returns:
        the path.
    Raises:
        ImportError: no such script, or the name is in several folders.
    """
    direct = SCRIPTS / f"{name}.py"
    if direct.is_file():
        return direct
    found = sorted(SCRIPTS.glob(f"*/{name}.py"))
    if len(found) != 1:
        raise ImportError(f"no single script {name}.py under {SCRIPTS}: {found}")
    return found[0]


def load_script(name: str) -> ModuleType:
    """Import a script (:func:`script_path`) as the module of its file name (once per
    process).

    Args:
        name: as :func:`script_path`, e.g. ``"cost_model"``.

    Returns:
        The module (also registered in ``sys.modules``, which its dataclasses need).
    """
    path = script_path(name)
    module_name = path.stem
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
