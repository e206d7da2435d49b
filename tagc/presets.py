"""The YAML presets shipped with the package, found by name.

The presets live in the checkout's top-level ``configs/`` folder, the one source of
truth; ``setup.py`` maps that folder to the package ``tagc.configs`` (``package_dir``),
so a wheel carries the same files as ``tagc/configs/*.yaml`` and a program run from
any folder finds them without a checkout.  In a source checkout that is not installed
as a wheel (``pip install -e .`` or ``python -m pytest`` from the root), the folder
next to the package is the same ``configs/``.

Names: ``"balanced"``, ``"tagc-balanced"``, ``"tagc-balanced.yaml"`` and the training
configs' ``"train-tiny"`` all resolve; a path to an existing ``.yaml`` file is taken as
it is.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Dict, List, Union

__all__ = ["config_dir", "names", "resolve", "load_mapping", "PIPELINE_PREFIX"]

# The pipeline presets (tagc.pipeline.PipelineConfig, ``train_gpt2.py --pp``) are named
# tagc-pp-*; every other tagc-* preset is a TAGCConfig of the data-parallel hook.
PIPELINE_PREFIX = "tagc-pp-"


def config_dir() -> Path:
    """The folder holding the shipped presets.

    Returns:
        ``tagc/configs`` of an installed wheel, else the checkout's ``configs/``.
    Raises:
        FileNotFoundError: neither exists (a broken install).
    """
    spec = importlib.util.find_spec("tagc.configs")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if any(Path(loc).glob("*.yaml")):
            return Path(loc)
    checkout = Path(__file__).resolve().parents[1] / "configs"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError("tagc: no presets found (neither tagc/configs of an installed "
                            f"wheel nor {checkout}); reinstall the package")


def names() -> List[str]:
    """Every shipped preset, by file stem (``tagc-balanced``, ``train-tiny``, ...).

    Returns:
        the sorted names.
    """
    return sorted(p.stem for p in config_dir().glob("*.yaml"))


def resolve(name: Union[str, Path]) -> Path:
    """The YAML file of a preset name, or the given file itself.

    Args:
        name: an existing ``.yaml``/``.yml`` file, or a shipped preset's name with or
            without the ``tagc-`` prefix and the ``.yaml`` suffix
            (``"balanced"``, ``"tagc-balanced"``, ``"configs/tagc-balanced.yaml"``).
    Returns:
        the file's path.
    Raises:
        ValueError: neither a file nor a shipped preset (the message lists them).
    """
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    stem = path.name[:-len(path.suffix)] if path.suffix in (".yaml", ".yml") else path.name
    folder = config_dir()
    for cand in (stem, f"tagc-{stem}"):
        if (folder / f"{cand}.yaml").is_file() and (path.parent == Path(".") or
                                                    path.parent.name == "configs"):
            return folder / f"{cand}.yaml"
    raise ValueError(f"no preset or file {str(name)!r}; the shipped presets: "
                     f"{', '.join(names())}")


def load_mapping(path: Union[str, Path]) -> Dict[str, Any]:
    """The field mapping of a YAML preset file (an empty file is an empty mapping).

    Raises:
        ValueError: the file holds something other than a mapping.
    """
    import yaml

    with open(path, "r", encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data
