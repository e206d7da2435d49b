"""The tests' access to the scripts of ``scripts/`` (a folder of programs, not a package).

The harness they share is the ``tagc.train`` package; the tests of a script's own
logic (tables, reports, bookkeeping) load that script by its path with
:func:`load_script`, as ``python scripts/NAME.py`` would, without putting ``scripts/``
on ``sys.path``.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """Import ``scripts/<name>.py`` as the module ``name`` (once per process).

    Args:
        name: the script's file name without ``.py``, e.g. ``"cost_model"``.

    Returns:
        The module (also registered in ``sys.modules``, which its dataclasses need).
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no script {SCRIPTS / name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
