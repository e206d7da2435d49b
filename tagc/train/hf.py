"""Hugging Face causal LMs in the training harness: scripts/finetune_hf.py.

The model comes from a local checkpoint folder (``--hf_model``: config.json and weights,
read with ``local_files_only``; its tokenizer too when the folder has one) or is built
fresh from a model type and config fields (``--hf_config llama:hidden_size=256,...``).
Nothing is downloaded.  Everything else (data, logs, metrics, checkpoints, TAGC) is
:mod:`tagc.train.loop`'s, with the same options.

A built model without a tokenizer folder trains on byte tokens (its vocab_size is set to
cover them when not given).  Without ``--tagc`` the units are the model's transformer
blocks (its ``_no_split_modules``); with it, TAGC's own layout.
"""
from __future__ import annotations

import os

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from tagc.train.config import RunConfig, option, build_parser, parse_config
from tagc.train.data import Tokenizer
from tagc.train.loop import Env, ModelSpec, load_data, run, setup
from tagc.train.optim import decayed_parameter_names


# the --help description of scripts/finetune_hf.py
DESCRIPTION = "Train or fine-tune a Hugging Face causal LM with PyTorch FSDP, with or without TAGC."


@dataclass
class FinetuneConfig(RunConfig):
    """The harness's run knobs, and where the model comes from."""

    out_dir: str = option("out/hf", "run folder: metrics.csv, summary.json, ckpt/, tb/")
    learning_rate: float = option(3e-4, "peak learning rate (AdamW)")
    min_lr: float = option(3e-5, "learning rate at the end of the cosine decay")
    hf_model: str = option("", "a local Hugging Face checkpoint folder (config.json + weights; "
                               "its tokenizer is used when present); nothing is downloaded")
    hf_config: str = option("", "build a new model instead: 'model_type:field=value,...' "
                                "(e.g. llama:hidden_size=256,num_hidden_layers=4)")

    def validate(self) -> None:
        super().validate()
        if bool(self.hf_model) == bool(self.hf_config):
            raise ValueError("give exactly one of --hf_model (a checkpoint folder) and "
                             "--hf_config (model_type:field=value,...)")
        if self.hf_model and not (Path(self.hf_model) / "config.json").is_file():
            raise ValueError(f"--hf_model {self.hf_model}: no config.json there (a local "
                             "checkpoint folder is needed; nothing is downloaded)")
        if self.hf_config:
            parse_hf_config(self.hf_config)


def parse_hf_config(spec: str) -> Tuple[str, Dict[str, Any]]:
    """``model_type:field=value,...`` -> (model type, fields read as YAML values)."""
    import yaml

    mtype, _, rest = spec.partition(":")
    if not mtype.strip():
        raise ValueError(f"--hf_config: expected model_type:field=value,..., got {spec!r}")
    fields: Dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--hf_config: expected field=value, got {part!r}")
        fields[key.strip()] = yaml.safe_load(value)
    return mtype.strip(), fields


def hf_tokenizer(cfg: FinetuneConfig) -> Optional[Tokenizer]:
    """The checkpoint folder's own tokenizer, wrapped for tagc.train.data (None: none there)."""
    if not cfg.hf_model or not any((Path(cfg.hf_model) / f).is_file() for f in
                                   ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    tk = AutoTokenizer.from_pretrained(cfg.hf_model, local_files_only=True)
    eot = tk.eos_token_id if tk.eos_token_id is not None else len(tk) - 1

    def encode(text: str) -> list:
        return tk(text, add_special_tokens=False)["input_ids"]

    return Tokenizer(name=f"hf-{Path(cfg.hf_model).resolve().name}",
                               vocab_size=len(tk), eot=eot, encode=encode)


def _block_classes(model: nn.Module) -> list:
    names = set(getattr(model, "_no_split_modules", None) or [])
    return sorted({type(m) for m in model.modules() if type(m).__name__ in names},
                  key=lambda c: c.__name__)


def hf_spec(cfg: FinetuneConfig, env: Env, vocab_size: int) -> ModelSpec:
    """The model, from the checkpoint or built from ``--hf_config``, on this rank."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if cfg.hf_model:
        model = AutoModelForCausalLM.from_pretrained(cfg.hf_model, local_files_only=True,
                                                     dtype=torch.float32)
        if model.get_input_embeddings().num_embeddings < vocab_size:
            raise ValueError(f"{cfg.hf_model}: {model.get_input_embeddings().num_embeddings} "
                             f"embeddings, the tokenizer has {vocab_size} tokens")
        what = f"{cfg.hf_model}"
    else:
        mtype, fields = parse_hf_config(cfg.hf_config)
        fields.setdefault("vocab_size", (vocab_size + 63) // 64 * 64)
        if fields["vocab_size"] < vocab_size:
            raise ValueError(f"--hf_config: vocab_size {fields['vocab_size']} < the "
                             f"tokenizer's {vocab_size} tokens")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mtype, **fields))
        what = f"new {mtype} ({cfg.hf_config.partition(':')[2]})"
    model = model.to(env.device)
    blocks = _block_classes(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer block class "
                         "(_no_split_modules): use --tagc or --wrap tagc")

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=x).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    n_params = sum(p.numel() for p in model.parameters())
    return ModelSpec(model, n_params, decayed_parameter_names(model), blocks, loss,
                     f"model {type(model).__name__} {what}")


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run one job; returns the summary (also written to out_dir/summary.json)."""
    try:
        cfg = parse_config(argv, FinetuneConfig, "finetune_hf.py", DESCRIPTION)
    except ValueError as exc:
        if argv is not None:
            raise
        build_parser(FinetuneConfig, "finetune_hf.py").exit(
            2, f"finetune_hf.py: error: {exc}\n")
    env = setup(cfg, "scripts/finetune_hf.py")
    data, tok = load_data(cfg, hf_tokenizer(cfg))
    return run(cfg, env, hf_spec(cfg, env, tok.vocab_size), data, tok)


if __name__ == "__main__":  # python -m tagc.train.hf, as scripts/finetune_hf.py
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
