"""The optimizer and learning-rate schedule of the training harness (nanoGPT's)."""
from __future__ import annotations

import math
from typing import List, Tuple

import torch
import torch.nn as nn

from tagc.train.config import RunConfig


def decayed_parameter_names(model: nn.Module) -> set:
    """Names of the parameters that get weight decay: matrices and embeddings (dim >= 2).

    Call on the unwrapped model: FSDP1 with use_orig_params shows sharded parameters as
    1-D views, so their shape no longer tells.
    """
    return {name for name, p in model.named_parameters() if p.dim() >= 2}


def _clean_fqn(name: str) -> str:
    return ".".join(part for part in name.split(".")
                    if part not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"))


def configure_optimizer(model: nn.Module, decayed: set, weight_decay: float, lr: float,
                        betas: Tuple[float, float]) -> torch.optim.AdamW:
    """AdamW with weight decay on the `decayed` parameters only, as nanoGPT.

    Args:
        model: the (wrapped) model; FSDP1 must use use_orig_params=True.
        decayed: names from decayed_parameter_names() of the unwrapped model.
        weight_decay, lr, betas: AdamW settings.

    Returns:
        The optimizer.
    """
    groups: Tuple[List[nn.Parameter], List[nn.Parameter]] = ([], [])
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups[0 if _clean_fqn(name) in decayed else 1].append(p)
    if not groups[0] or not groups[1]:
        raise RuntimeError("parameter groups by name failed: one group is empty")
    return torch.optim.AdamW([{"params": groups[0], "weight_decay": weight_decay},
                              {"params": groups[1], "weight_decay": 0.0}],
                             lr=lr, betas=betas)


def get_lr(it: int, cfg: RunConfig) -> float:
    """Linear warmup then cosine decay to min_lr (nanoGPT's schedule)."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)
