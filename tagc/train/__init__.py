"""The training harness of scripts/train_gpt2.py, scripts/finetune_hf.py and the
benchmark and quality scripts (installed with the project; ``tagc_hook`` never imports it).

Modules, in reading order:

* ``config``: the run's knobs (:class:`RunConfig`, GPT-2's :class:`TrainConfig`), read
  from YAML files and ``--key=value`` options;
* ``model``: GPT-2 (nanoGPT's layout); ``data``: token sources, tokenizers, the token
  cache and batches;
* ``optim``: AdamW groups and the learning-rate schedule;
* ``sharding``: FSDP1/FSDP2 wrapping, with TAGC's unit layout or one unit per block;
* ``metrics``: gradient bytes per rank (:class:`GradBytes`) and metrics.csv/TensorBoard;
* ``checkpoint``: save and bit-exact resume through torch.distributed.checkpoint;
* ``loop``: process group, the training loop and :func:`main` (scripts/train_gpt2.py);
* ``hf``: Hugging Face causal LMs (scripts/finetune_hf.py);
* ``launch``: N gloo ranks in new processes (``run_dist``), for experiments;
* ``runs``: launching training runs as subprocesses, their provenance and reuse.

The names below are imported lazily, so ``python -m tagc.train.data`` and the
stdlib-only ``runs`` load without the rest.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RunConfig": "config", "TrainConfig": "config", "parse_config": "config",
    "build_parser": "config", "load_tagc_config": "config",
    "GPT": "model", "GPTConfig": "model", "Block": "model", "MODEL_SIZES": "model",
    "TokenData": "data", "Tokenizer": "data",
    "configure_optimizer": "optim", "decayed_parameter_names": "optim", "get_lr": "optim",
    "wrap_model": "sharding", "GradBytes": "metrics", "MetricsLog": "metrics",
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint",
    "Env": "loop", "ModelSpec": "loop", "setup": "loop", "load_data": "loop",
    "run": "loop", "main": "loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import ``name`` from its module on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
