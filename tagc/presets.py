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

__all__ = ["config_dir", "names", "resolve", "load_mapping", "purpose", "PIPELINE_PREFIX",
           "PURPOSES"]

# The pipeline presets (tagc.pipeline.PipelineConfig, ``train_gpt2.py --pp``) are named
# tagc-pp-*; every other tagc-* preset is a TAGCConfig of the data-parallel hook.
PIPELINE_PREFIX = "tagc-pp-"

# What each shipped preset is for, in one line (``train_gpt2.py --help`` lists them);
# the files' own comments say how.
PURPOSES: Dict[str, str] = {
    "tagc-balanced": "recommended: int4 gradients with feedback, ~7x fewer gradient bytes",
    "tagc-full": "tagc-balanced plus int8 parameter all-gathers (needs --fsdp 2)",
    "tagc-full4": "tagc-full with int4 gathers of the weights' change (needs --fsdp 2)",
    "tagc-lean": "ternary gradients (tls: scales per 32), no feedback, ~18x fewer gradient bytes",
    "tagc-local": "local steps between nodes, DiLoCo (needs --fsdp 2 --replicas R)",
    "tagc-auto": "lossless top-k, each message in its smallest coding",
    "tagc-exact": "lossless top-k (bitmap + sketch), the paper's 10x sparsity",
    "tagc-exact-warmup": "tagc-exact after a dense warm-up and a sparsity ramp",
    "tagc-sparse": "top-k (offset, value) pairs by isend/irecv",
    "tagc-sparse-warmup": "tagc-sparse with tagc-exact-warmup's warm-up",
    "tagc-sparse-t90-warmup": "tagc-sparse-warmup keeping 10% of each shard",
    "tagc-dense": "no compression, all-to-all: the baseline on gloo",
    "tagc-2x-1bit": "the paper's 2x preset, 1-bit index lanes",
    "tagc-2x-4bit": "the paper's 2x preset, 4-bit index lanes",
    "tagc-4x-1bit": "the paper's 4x preset, 1-bit index lanes",
    "tagc-4x-4bit": "the paper's 4x preset, 4-bit index lanes",
    "tagc-10x-1bit": "the paper's 10x preset, 1-bit index lanes",
    "tagc-10x-4bit": "the paper's 10x preset, 4-bit index lanes",
    "tagc-10x-1bit-warmup": "tagc-10x-1bit after a dense warm-up",
    "tagc-pp-int8": "pipeline stage boundaries as int8 codes (--pp)",
    "tagc-pp-int4": "pipeline stage boundaries as int4 codes (--pp)",
    "tagc-pp-subspace": "pipeline boundaries in a fixed subspace (--pp)",
    "train-tiny": "run settings: tiny GPT-2 on the built-in corpus (CPU)",
    "train-gpt2": "run settings: the paper's GPT-2 small on OpenWebText (GPUs)",
}


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


def purpose(name: str) -> str:
    """What a shipped preset is for, in one line.

    Args:
        name: the preset's file stem (``names()``).
    Returns:
        its line of ``PURPOSES``, else its file's first comment line (a preset added
        without a line here still gets one).
    """
    if name in PURPOSES:
        return PURPOSES[name]
    with open(resolve(name), "r", encoding="utf-8") as fh:
        first = fh.readline().strip()
    return first.lstrip("#").strip() if first.startswith("#") else ""


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
