"""What the one-process probes share (``scripts/research/sim_ablation.py`` and
``sim_feedback.py``, its ``--task gpt2``): the tiny GPT-2's learning-rate schedule and
its validation loss, so both probes train and score that model alike.
"""
from __future__ import annotations

import argparse
import math

import torch

from tagc.train.data import TokenData

# train-tiny.yaml's warm-up steps
WARMUP = 30


def lr_at(it: int, args: argparse.Namespace) -> float:
    """``configs/train-tiny.yaml``'s schedule: linear warm-up over :data:`WARMUP` steps,
    then cosine to lr/10 at ``args.steps``.

    Args:
        it: the step (from 0).
        args: ``lr`` (the peak) and ``steps`` (the run's length).
    Returns:
        the learning rate.
    """
    lr, mn, wu = args.lr, args.lr / 10, WARMUP
    if it < wu:
        return lr * (it + 1) / wu
    r = (it - wu) / max(1, args.steps - wu)
    return mn + 0.5 * (1 + math.cos(math.pi * r)) * (lr - mn)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: TokenData, args: argparse.Namespace) -> float:
    """Mean validation loss over 16 fixed batches.

    Args:
        model: a GPT (``model(x, y)[1]`` is the loss).
        data: the token data.
        args: ``batch_size``, ``block_size`` and ``seed`` (which fixes the batches).
    Returns:
        the loss.
    """
    return sum(float(model(*data.get_batch("val", args.batch_size, args.block_size,
                                           (args.seed, 1, k, 0)))[1])
               for k in range(16)) / 16
