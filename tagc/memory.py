"""What TAGC's feedback state costs in memory: one place for the layout of a reducer's
persistent buffers and their bytes.

A compressing unit with ``error_feedback`` keeps, per rank and across steps:

* a **residual** over the reducer's whole input (every shard this rank sends, its own
  included): ``residual_dtype`` values (4 or 2 bytes per entry) or, with
  ``residual_code``, block codes of ``quant_block`` entries (``int8``: 1 + 4/block
  bytes per entry, ``int4``: 0.5 + 4/block), decoded into a transient fp32 copy only
  for the length of a call;
* with ``ef21``, the owner's **estimate** of its shard of the sum (fp32, 1/N of the
  input);
* under TAGC's two-phase HSDP, the to-everyone phase's state: ``residual_out`` (one
  chunk, the residual's storage) or EF21's ``estimate_out`` (every chunk, fp32).

With local steps (``outer_every``) every unit's reducer also keeps the outer state:
two fp32 shards, step counters, and with ``outer_overlap`` a third shard while a sync
is in flight (:func:`outer_buffers`).

The reducers take their buffers' layout from here (checkpoints store exactly those),
``TAGCState.stats()`` adds up what they hold, and the cost model's cluster table
(``tagc.cost.cluster.feedback_bytes``) asks what a model would need before it is built.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch

from .config import TAGCConfig

# (attribute, length, dtype) of one persistent buffer
Buffer = Tuple[str, int, torch.dtype]


def coded_bytes(n: int, fmt: str, block: int) -> int:
    """Bytes of ``n`` values on ``fmt`` block codes (the codec's size rule).

    Args:
        n: values.
        fmt: a quant format (``int8``, ``int4``, ...).
        block: values per fp32 scale.
    Returns:
        ``_tagc.quant_bytes(n, fmt, block)``.
    """
    from .codec import _tagc, require_codec

    require_codec()
    return int(_tagc.quant_bytes(n, fmt, block))


def residual_buffer(cfg: TAGCConfig, name: str, length: int) -> Buffer:
    """The persistent form of a residual over ``length`` gradient entries.

    Args:
        cfg: the config (``residual_code``, ``residual_dtype``, ``quant_block``).
        name: the reducer attribute holding it.
        length: entries the residual covers.
    Returns:
        ``(name, length, residual_dtype)``, or with ``residual_code`` the codes'
        ``(name, bytes, torch.uint8)``.
    """
    if cfg.residual_code == "none":
        return name, length, cfg.residual_dtype
    return name, coded_bytes(length, cfg.residual_code, cfg.quant_block), torch.uint8


def unit_buffers(cfg: TAGCConfig, length: int, estimate: int) -> List[Buffer]:
    """The to-the-owner phase's persistent buffers of one compressed unit.

    Args:
        cfg: the config.
        length: the reducer's input (the flat unit: every shard this rank sends).
        estimate: the sum this rank receives (its shard; HSDP's all-gather form:
            the whole input), EF21's estimate.
    Returns:
        the residual, then EF21's estimate; empty without feedback.
    """
    if not cfg.feeds_back:
        return []
    out = [residual_buffer(cfg, "residual", length)]
    if cfg.ef21:
        out.append(("estimate", estimate, torch.float32))
    return out


def out_buffers(cfg: TAGCConfig, chunk: int, replicas: int) -> List[Buffer]:
    """Two-phase HSDP's to-everyone state of one compressed unit (``TwoPhaseReducer``):
    the owner's ``residual_out`` over its chunk, or EF21's ``estimate_out`` of every
    owner's chunk; none without feedback or with lossless codes (``exact``/``paper``).

    Args:
        cfg: the config.
        chunk: one owner's chunk of the shard.
        replicas: R, the owners.
    Returns:
        the buffers.
    """
    if not cfg.feeds_back or cfg.sketched:
        return []
    if cfg.ef21:
        return [("estimate_out", chunk * replicas, torch.float32)]
    return [residual_buffer(cfg, "residual_out", chunk)]


def buffer_bytes(buffers: List[Buffer]) -> int:
    """Bytes the buffers hold."""
    return sum(n * torch.empty((), dtype=d).element_size() for _, n, d in buffers)


def outer_buffers(cfg: TAGCConfig, shard: int) -> List[Buffer]:
    """Local steps' outer state of one unit (``outer_every``, tagc/local.py), as its
    replica reducer keeps it.

    Args:
        cfg: the config.
        shard: the unit's shard on this rank.
    Returns:
        the last sync's shard and the outer momentum (fp32), the step counters (inner
        steps, the step a sync in flight merges at), and with ``outer_overlap`` the
        average of a sync in flight (fp32); empty without local steps.
    """
    if not cfg.outer_every:
        return []
    out = [("outer_start", shard, torch.float32), ("outer_momentum", shard, torch.float32),
           ("outer_inner", 2, torch.int64)]
    if cfg.outer_overlap:
        out.append(("outer_avg", shard, torch.float32))
    return out


def outer_bytes(cfg: TAGCConfig, numel: int, world: int, replicas: int) -> int:
    """Persistent bytes one rank holds for local steps' outer state of one unit of
    ``numel`` parameters (:func:`outer_buffers` of its shard); every unit, compressed
    or not (each has an outer step).

    Args:
        cfg: the config.
        numel: the unit's parameters.
        world: ranks the unit is sharded over (a node's).
        replicas: R (local steps need R > 1).
    Returns:
        bytes (0 without local steps).
    """
    if replicas <= 1:
        return 0
    return buffer_bytes(outer_buffers(cfg, math.ceil(numel / world)))
