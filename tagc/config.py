"""TAGCConfig: every knob of TAGC, grouped by the feature that reads it, documented once
and validated by that group's check.

``TAGCConfig()`` is the recommended preset, ``tagc-balanced`` (mode ``quant``, int4
codes on every layer, the residual feedback kept on int4 codes); the other shipped
presets load by name: ``TAGCConfig.preset("full")`` (int8 parameter gathers too,
FSDP2), ``TAGCConfig.preset("lean")`` (ternary ``tls`` codes, no feedback state), ...
``TAGCConfig.describe()`` lists the knobs by group; docs/USAGE.md's knob reference is
generated from it (:func:`write_knobs_doc`), and docs/RESULTS.md has the measurements.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import textwrap
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.nn as nn

MODES = ("paper", "exact", "sparse", "auto", "quant", "dense")
QUANT_FORMATS = ("sign", "ternary", "int4", "int8", "tls")
# Code density of each block-record quant format, bits per value (scales excluded; tls,
# ternary codes under two-level scales, has a layout of its own): ternary packs
# 5 codes per byte.  Each block's codes start on a fresh byte, so the wire cost per
# value depends on the block (ternary: 1.625 at 256, since 256 codes take 52 bytes);
# the exact size of a shard is `_tagc.quant_bytes(n, format, block)`, which every
# transport sizes its messages by.
QUANT_BITS = {"sign": 1.0, "ternary": 1.6, "int4": 4.0, "int8": 8.0}
# Parameter all-gather formats (FSDP2): "none" leaves FSDP's own all-gather alone;
# int8/int4 uniform codes with a fp32 scale per block (_tagc.wq_*); fp4 E2M1 codes with
# a power-of-two (E8M0) scale per block (_tagc.fp4_*, OCP microscaling's MXFP4).
GATHER_FORMATS = ("none", "int8", "int4", "fp4")
# fp4 blocks: powers of two up to the codec's TAGC_FP4_BLOCK_MAX
FP4_BLOCK_MAX = 256
HSDP_ALLREDUCE_FORMS = ("auto", "two_phase", "gather")
# How a residual is kept between calls (TAGCConfig.residual_code): "none" as values of
# residual_dtype, or as block codes.
RESIDUAL_CODES = ("none", "int8", "int4")
# The paper's compression presets: ratio -> sparsity (Table/Section 4 of the paper).
PAPER_THETA: Dict[float, float] = {2.0: 0.80, 4.0: 0.90, 10.0: 0.9875}
# The feedback guard's threshold when guard_ratio is left at None and EF21 is on: well
# above what healthy runs reach, far below what a corrupted state reads (docs/DESIGN.md
# section 5, "When feedback drifts").
DEFAULT_GUARD_RATIO = 256.0
_FLOAT_DTYPES = {"float32": torch.float32, "fp32": torch.float32,
                 "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

LayerPolicy = Union[str, Callable[[str, nn.Module, str, nn.Parameter], bool]]


def _from_mapping(cls: Any, d: Any, what: str) -> Any:
    """``cls(**d)`` for a config dataclass; a non-mapping or an unknown key raises.

    Args:
        cls: the dataclass.
        d: mapping of field names to values.
        what: the config's name in the message.
    Returns:
        the validated config.
    """
    if not isinstance(d, dict):
        raise ValueError(f"{what}: expected a mapping, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{what}: unknown config key(s) {unknown}; known: {sorted(known)}")
    return cls(**d)


def _check_int(name: str, v: Any, lo: int, hi: Optional[int] = None) -> None:
    """v must be an int (not a bool) in [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        want = f">= {lo}" if hi is None else \
            ("in [0, 2^64)" if hi == 2 ** 64 - 1 else f"in [{lo}, {hi}]")
        raise ValueError(f"{name}: must be an int {want}, got {v!r}")


def _check_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{name}: must be a bool, got {v!r}")


def _parse_dtype(value: Any, field_name: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in (torch.float32, torch.bfloat16):
            return value
    elif isinstance(value, str):
        key = value.lower().replace("torch.", "")
        if key in _FLOAT_DTYPES:
            return _FLOAT_DTYPES[key]
    raise ValueError(f"{field_name}: must be torch.float32 or torch.bfloat16 "
                     f"(or 'float32'/'bf16'), got {value!r}")


def keep_count(theta: float, s: int) -> int:
    """Entries a rank keeps of a shard of ``s`` at sparsity ``theta``: ceil((1-theta) s),
    at least 1 and at most s (the one rule every transport and tool sizes by).

    Args:
        theta: sparsity in [0, 1).
        s: shard length (>= 1).
    Returns:
        k.
    """
    # round() guards against (1 - 0.9875) * 800 == 10.000000000000009
    return min(max(math.ceil(round((1.0 - theta) * s, 9)), 1), s)


# Bits per value on the wire at which a code stops paying: fp32 sends 32 (a code at that
# or more costs more than no compression), bf16 16 (a code at that or more saves nothing
# over a bf16 reduce).
CODE_REFUSE_BITS = 32.0
CODE_WARN_BITS = 16.0
# (block knob, block, formats) already warned about: each warning comes once per process.
_WARNED_CODES: Set[Tuple[str, int, Tuple[str, ...]]] = set()


def code_bits(fmt: str, block: int, gather: bool = False) -> float:
    """Bits per value of ``fmt`` codes in blocks of ``block``, scales included, by the
    codec's own size rule over full blocks (a shard's short last block aside).

    Args:
        fmt: a quant format (``QUANT_FORMATS``) or, with ``gather``, a gather format.
        block: values per fp32 scale.
        gather: size by ``_tagc.wq_bytes`` (the parameter gather's and the pipeline's
            block records) instead of ``_tagc.quant_bytes``.
    Returns:
        ``8 * bytes / block`` of one full block.
    Raises:
        ImportError: the ``_tagc`` codec is not built.
    """
    from .codec import OWN_PERIOD, _tagc, quant_bytes, require_codec

    require_codec()
    if gather and fmt == "fp4":
        nbytes = _tagc.fp4_bytes(block, block)
    elif gather:
        nbytes = _tagc.wq_bytes(torch.tensor([block], dtype=torch.int64), fmt, block)
    else:
        # a format with blocks of its own: one period of its scales, whatever `block` says
        block = OWN_PERIOD.get(fmt, block)
        nbytes = quant_bytes(block, fmt, block)
    return 8.0 * int(nbytes) / block


def _smallest_block(fmt: str, gather: bool) -> int:
    """The smallest block whose codes take fewer than ``CODE_WARN_BITS`` per value."""
    block = 1
    while code_bits(fmt, block, gather) >= CODE_WARN_BITS:
        block += 1
    return block


# One block code a config puts to use: (format knob, format, block knob, block, sized
# by wq_bytes rather than quant_bytes).
CodeUse = Tuple[str, str, str, int, bool]


def coded_pairs(cfg: "TAGCConfig") -> List[CodeUse]:
    """The block codes a config puts to use.

    A knob that has no effect (``quant_format`` outside ``quant`` mode, a residual code
    where no residual is kept) adds nothing, since it costs no bytes.

    Args:
        cfg: the config, its derived knobs resolved.
    Returns:
        ``(format knob, format, block knob, block, gather)`` of each code.
    """
    q, g = ("quant_block", cfg.quant_block, False), ("gather_block", cfg.gather_block, True)
    out = []
    if cfg.quantizes:
        out.append(("quant_format", cfg.quant_format, *q))
        # two-phase HSDP's owners code their chunk of the sum on it
        out.append(("hsdp_out_format", cfg.out_format(), *q))
    if cfg.feeds_back and cfg.residual_code != "none":
        out.append(("residual_code", cfg.residual_code, *q))
    if cfg.gather != "none":
        out.append(("gather", cfg.gather, *g))
    return out


def check_block_codes(uses: List[CodeUse]) -> None:
    """Refuse block codes that take at least fp32's bits per value; warn (once per
    process, block knob, block and formats) about those at bf16's or more.

    Small blocks are dominated by their fp32 scale: at block 1 every format takes 40
    bits per value, 25% more than sending the values uncompressed.  Without the codec
    built nothing is checked (a compressing run cannot start without it either).

    Args:
        uses: the codes, as :func:`coded_pairs` lists them.
    Raises:
        ValueError: a code reaches ``CODE_REFUSE_BITS``; the message names its knobs
            and the smallest block that brings every code on that block knob under
            ``CODE_WARN_BITS``.
    """
    from .codec import _tagc

    if _tagc is None:
        return
    for block_knob in dict.fromkeys(u[2] for u in uses):
        mine = [u for u in uses if u[2] == block_knob]
        block, gather = mine[0][3], mine[0][4]
        bits = {fmt: code_bits(fmt, block, gather) for _, fmt, *_ in mine}
        bad = sorted(f for f, v in bits.items() if v >= CODE_WARN_BITS)
        if not bad:
            continue
        what = "; ".join(
            f"{', '.join(u[0] for u in mine if u[1] == fmt)} with {block_knob}={block}: "
            f"{fmt} codes take {bits[fmt]:.3g} bits per value on the wire, scales included"
            for fmt in bad)
        fix = (f"use {block_knob} >= {max(_smallest_block(f, gather) for f in bits)} (the "
               f"smallest under {CODE_WARN_BITS:g} bits for every code on it)")
        if max(bits.values()) >= CODE_REFUSE_BITS:
            raise ValueError(f"{what}: at least fp32's {CODE_REFUSE_BITS:g}, more bytes "
                             f"than no compression; {fix}")
        key = (block_knob, block, tuple(bad))
        if key not in _WARNED_CODES:
            _WARNED_CODES.add(key)
            warnings.warn(f"{what}: at least bf16's {CODE_WARN_BITS:g}, little or nothing "
                          f"saved; {fix}", stacklevel=2)


# --------------------------------------------------------------------------- knob groups

# Knob groups in the order they are validated and documented: (name, title, what the
# feature does).  A knob names its group in its field's metadata (:func:`knob`).
GROUPS: Tuple[Tuple[str, str, str], ...] = (
    ("codec", "Codec", "what a compressed unit's gradient sends and how it is coded"),
    ("selection", "Selection", "which parameters are compressed"),
    ("feedback", "Feedback", "what each rank keeps of what it did not send"),
    ("schedule", "Schedule", "when a unit compresses and when it sends plainly"),
    ("gather", "Parameter gathers", "FSDP2's parameter all-gathers on block codes"),
    ("overlap", "Overlap", "communication on a worker thread while the model computes "
     "(CPU)"),
    ("hsdp", "HSDP", "the compressed all-reduce between replicas (tagc/hsdp.py)"),
    ("local", "Local steps", "an outer sync every H steps between replicas (DiLoCo, "
     "tagc/local.py)"),
)


def knob(default: Any, group: str, doc: str, *, values: str, reads: str,
         derived: Optional[str] = None) -> Any:
    """A ``TAGCConfig`` field carrying its documentation.

    Args:
        default: the field's default (None for a derived knob).
        group: the feature reading it, a name of ``GROUPS``.
        doc: what the knob does, one short paragraph.
        values: the values it takes.
        reads: the modes or routes that read it.
        derived: for a knob whose default follows other knobs, that rule.
    Returns:
        the ``dataclasses.field``.
    Raises:
        ValueError: ``group`` is not one of ``GROUPS``.
    """
    if group not in {g[0] for g in GROUPS}:
        raise ValueError(f"knob: unknown group {group!r}")
    return dataclasses.field(default=default, metadata={
        "group": group, "doc": doc, "values": values, "reads": reads, "derived": derived})


def _check_number(name: str, v: Any, ok: Callable[[float], bool], want: str) -> float:
    """v must be a finite int or float (not a bool) for which ``ok`` holds.

    Args:
        name: the knob, first word of the message.
        v: its value.
        ok: the range test.
        want: the range in words.
    Returns:
        ``float(v)``.
    Raises:
        ValueError: v is not such a number.
    """
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not ok(v):
        raise ValueError(f"{name}: must be {want}, got {v!r}")
    return float(v)


def _check_choice(name: str, v: Any, choices: Tuple[str, ...]) -> None:
    """v must be one of ``choices``."""
    if v not in choices:
        raise ValueError(f"{name}: must be one of {choices}, got {v!r}")


def _resolve_sparsity(cfg: "TAGCConfig") -> None:
    """theta and ratio: paper mode derives one from the other (its presets), quant
    sends everything (theta 0), the other modes default to 0.9875."""
    if cfg.mode == "paper":
        if cfg.ratio is None:
            if cfg.theta is None:
                cfg.ratio = 10.0
            else:
                inv = {th: r for r, th in PAPER_THETA.items()}
                if float(cfg.theta) not in inv:
                    raise ValueError(
                        f"ratio: required in paper mode when theta={cfg.theta} is not "
                        f"one of the paper's presets {sorted(inv)}")
                cfg.ratio = inv[float(cfg.theta)]
        if not math.isfinite(cfg.ratio) or cfg.ratio < 1.0:
            raise ValueError(f"ratio: must be a finite number >= 1, got {cfg.ratio!r}")
        cfg.ratio = float(cfg.ratio)
        if cfg.theta is None:
            if cfg.ratio not in PAPER_THETA:
                raise ValueError(
                    f"theta: no paper default for ratio={cfg.ratio}; give theta "
                    f"(paper presets: {PAPER_THETA})")
            cfg.theta = PAPER_THETA[cfg.ratio]
    else:
        if cfg.ratio is not None:
            raise ValueError(f"ratio: only used by mode='paper' (mode={cfg.mode!r}); "
                             "set theta instead")
        if cfg.mode == "quant":
            if cfg.theta not in (None, 0, 0.0):
                raise ValueError(f"theta: mode='quant' sends every entry (theta 0); "
                                 f"got {cfg.theta!r}")
            cfg.theta = 0.0
        if cfg.theta is None:
            cfg.theta = 0.9875
    cfg.theta = float(cfg.theta)
    if not (0.0 <= cfg.theta < 1.0):
        raise ValueError(f"theta: must be in [0, 1), got {cfg.theta!r}")


def check_codec(cfg: "TAGCConfig") -> None:
    """Validate the codec group, resolving ``theta`` and ``ratio``.

    Args:
        cfg: the config being built.
    Raises:
        ValueError: a knob out of range; the message starts with its name.
    """
    _check_choice("mode", cfg.mode, MODES)
    for name in ("theta", "ratio", "sketch_factor"):
        v = getattr(cfg, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{name}: must be a number, got {v!r}")
    _resolve_sparsity(cfg)
    if isinstance(cfg.index_bits, bool) or cfg.index_bits not in (1, 2, 4, 8):
        raise ValueError(f"index_bits: must be 1, 2, 4 or 8, got {cfg.index_bits!r}")
    cfg.value_dtype = _parse_dtype(cfg.value_dtype, "value_dtype")
    _check_int("seed", cfg.seed, 0, 2 ** 64 - 1)
    cfg.sketch_factor = _check_number("sketch_factor", cfg.sketch_factor, lambda v: v > 0,
                                      "a finite number > 0")
    _check_choice("quant_format", cfg.quant_format, QUANT_FORMATS)
    _check_int("quant_block", cfg.quant_block, 1, 65536)


def check_selection(cfg: "TAGCConfig") -> None:
    """Validate ``cfg``'s selection knobs (ValueError: a knob out of range, named first)."""
    if not callable(cfg.layers) and cfg.layers not in ("non_attention", "all"):
        raise ValueError(f"layers: must be 'non_attention', 'all' or a callable, "
                         f"got {cfg.layers!r}")
    _check_int("min_numel", cfg.min_numel, 0)


def check_feedback(cfg: "TAGCConfig") -> None:
    """Validate the feedback group, resolving ``ef21``, ``ef21_damping`` and
    ``residual_code`` (the codec group first: they follow ``mode``).

    Args:
        cfg: the config being built.
    Raises:
        ValueError: a knob out of range or a pair that cannot run together.
    """
    _check_bool("error_feedback", cfg.error_feedback)
    cfg.residual_dtype = _parse_dtype(cfg.residual_dtype, "residual_dtype")
    if cfg.ef21 is None:
        cfg.ef21 = False
    _check_bool("ef21", cfg.ef21)
    c = cfg.residual_code
    if c is None:
        # the top-k modes' residual holds most of what they leave out, and EF21's h
        # must add up to the owner's sum exactly: both keep values
        c = "int4" if cfg.mode == "quant" and cfg.error_feedback is True and \
            not cfg.ef21 and cfg.residual_dtype == torch.float32 else "none"
    if c not in RESIDUAL_CODES:
        raise ValueError(f"residual_code: must be None (derived) or one of "
                         f"{RESIDUAL_CODES}, got {c!r}")
    if c != "none" and cfg.residual_dtype != torch.float32:
        raise ValueError("residual_code: the residual's working copy is float32; leave "
                         "residual_dtype at float32 (or residual_code 'none')")
    cfg.residual_code = c
    if cfg.ef21 and (cfg.mode == "dense" or not cfg.error_feedback
                     or cfg.residual_dtype != torch.float32 or cfg.residual_code != "none"):
        raise ValueError("ef21: needs a compressing mode, error_feedback=True, "
                         "residual_dtype float32 and residual_code 'none' (the ranks' "
                         "estimates must add up to the owner's exactly)")
    f = cfg.residual_factor
    if f is None:
        f = 0.5 if cfg.mode == "quant" and cfg.error_feedback is True and not cfg.ef21 else 1.0
    cfg.residual_factor = _check_number("residual_factor", f, lambda v: 0.0 <= v <= 1.0,
                                        "None (derived) or a number in [0, 1]")
    if cfg.residual_factor != 1.0 and (cfg.ef21 or cfg.error_feedback is not True):
        raise ValueError("residual_factor: scales the residual feedback; it needs "
                         "error_feedback=True and no ef21 (EF21 damps itself: ef21_damping)")
    if cfg.ef21_damping is None:
        cfg.ef21_damping = cfg.ef21
    _check_bool("ef21_damping", cfg.ef21_damping)
    if cfg.ef21_damping and not cfg.ef21:
        raise ValueError("ef21_damping: damps EF21's estimate; it needs ef21=True")
    if cfg.guard_ratio is not None:
        cfg.guard_ratio = _check_number(
            "guard_ratio", cfg.guard_ratio, lambda v: v >= 0,
            "None (default), 0 (off) or a finite number > 0")
        if cfg.guard_ratio > 0 and not cfg.feeds_back:
            raise ValueError("guard_ratio: the guard watches the error-feedback state; it "
                             "needs error_feedback=True and a compressing mode (set 0 or "
                             "None)")


def check_schedule(cfg: "TAGCConfig") -> None:
    """Validate the schedule group (the codec group first: the warm-up ends at
    ``theta``).

    Args:
        cfg: the config being built.
    Raises:
        ValueError: a knob out of range or not available in ``mode``.
    """
    for name in ("dense_steps", "warmup_steps"):
        _check_int(name, getattr(cfg, name), 0)
    if cfg.warmup_steps and cfg.mode == "quant":
        raise ValueError("warmup_steps: mode='quant' has no sparsity to ramp; use "
                         "dense_steps")
    cfg.warmup_theta = _check_number("warmup_theta", cfg.warmup_theta,
                                     lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    if cfg.warmup_steps and cfg.warmup_theta > cfg.theta:
        raise ValueError(f"warmup_theta: the warm-up must start at most as sparse as "
                         f"theta={cfg.theta}, got {cfg.warmup_theta!r}")
    if cfg.warmup_steps and cfg.mode == "paper":
        raise ValueError("warmup_steps: not available in mode='paper' (its sketch has a "
                         "fixed S/ratio buckets sized for theta); use dense_steps, or "
                         "mode 'exact'/'sparse'/'auto'")
    _check_int("bypass_every", cfg.bypass_every, 0)
    if cfg.bypass_every == 1:
        raise ValueError("bypass_every: 0 (off) or >= 2 (a probe every P reductions), got 1")
    if cfg.bypass_every and not cfg.compresses:
        raise ValueError("bypass_every: needs a compressing mode (mode='dense' compresses "
                         "nothing to bypass)")


def check_gather(cfg: "TAGCConfig") -> None:
    """Validate ``cfg``'s parameter-gather knobs (ValueError: a knob out of range, named first)."""
    _check_choice("gather", cfg.gather, GATHER_FORMATS)
    _check_int("gather_block", cfg.gather_block, 1, 65536)
    _check_bool("gather_rotate", cfg.gather_rotate)
    if cfg.gather == "fp4":
        b = cfg.gather_block
        if b < 2 or b > FP4_BLOCK_MAX or b & (b - 1):
            raise ValueError(f"gather_block: fp4 codes take a power of two in [2, "
                             f"{FP4_BLOCK_MAX}], got {b}")
    elif cfg.gather_rotate:
        raise ValueError(f"gather_rotate: rotates fp4 gather codes only, not "
                         f"gather={cfg.gather!r}")
    _check_bool("gather_delta", cfg.gather_delta)
    if cfg.gather_delta and cfg.gather not in ("int8", "int4"):
        raise ValueError(f"gather_delta: codes the weights' change on int8 or int4 "
                         f"gathers, not gather={cfg.gather!r}")


def check_overlap(cfg: "TAGCConfig") -> None:
    """Validate ``cfg``'s overlap knobs (ValueError: a knob that is not a bool, named first)."""
    _check_bool("fsdp_overlap", cfg.fsdp_overlap)
    _check_bool("hsdp_overlap", cfg.hsdp_overlap)


def check_hsdp(cfg: "TAGCConfig") -> None:
    """Validate ``cfg``'s HSDP knobs (ValueError: a knob out of range, named first)."""
    _check_choice("hsdp_allreduce", cfg.hsdp_allreduce, HSDP_ALLREDUCE_FORMS)
    if cfg.hsdp_out_format != "auto" and cfg.hsdp_out_format not in QUANT_FORMATS:
        raise ValueError(f"hsdp_out_format: must be 'auto' or one of {QUANT_FORMATS}, "
                         f"got {cfg.hsdp_out_format!r}")


def check_local(cfg: "TAGCConfig") -> None:
    """Validate the local-steps group.

    Args:
        cfg: the config being built.
    Raises:
        ValueError: a knob out of range or needing ``outer_every``.
    """
    _check_int("outer_every", cfg.outer_every, 0)
    _check_int("outer_fragments", cfg.outer_fragments, 1)
    _check_int("outer_overlap", cfg.outer_overlap, 0)
    _check_number("outer_lr", cfg.outer_lr, lambda v: v > 0, "a finite number > 0")
    for name in ("outer_momentum", "outer_mix"):
        _check_number(name, getattr(cfg, name), lambda v: 0 <= v < 1, "a number in [0, 1)")
    if cfg.outer_every and cfg.outer_fragments > cfg.outer_every:
        raise ValueError(f"outer_fragments: at most outer_every ({cfg.outer_every}) "
                         f"fragments, got {cfg.outer_fragments}")
    if cfg.outer_overlap and (not cfg.outer_every or
                              cfg.outer_overlap >= cfg.outer_every // cfg.outer_fragments):
        raise ValueError(f"outer_overlap: needs outer_every and tau < outer_every // "
                         f"outer_fragments (one sync in flight), got {cfg.outer_overlap}")
    if (cfg.outer_fragments > 1 or cfg.outer_mix) and not cfg.outer_every:
        raise ValueError("outer_fragments / outer_mix: need outer_every >= 1 (local steps)")


# Each group's validator, run in GROUPS' order by TAGCConfig.__post_init__.
CHECKS: Dict[str, Callable[["TAGCConfig"], None]] = {
    "codec": check_codec, "selection": check_selection, "feedback": check_feedback,
    "schedule": check_schedule, "gather": check_gather, "overlap": check_overlap,
    "hsdp": check_hsdp, "local": check_local}


# --------------------------------------------------------------------------- config

_DOC_HEAD = """Every knob of TAGC, validated on construction; the defaults are ``tagc-balanced``.

The knobs are grouped by the feature that reads them (:meth:`describe`), each group
validated by its ``check_<group>`` function in tagc/config.py.  A derived knob, whose
default follows other knobs ({derived}), keeps following them
unless given: :meth:`to_dict` writes it as None when not given, so
``TAGCConfig.from_dict({{**c.to_dict(), "mode": "exact"}})`` and :meth:`replace`
re-derive it; :meth:`resolved_dict` has every value as used.
"""


@dataclass
class TAGCConfig:
    # The docstring is generated from the fields' metadata (describe()).  The fields
    # stay in this order rather than by group: positional construction and the
    # key order of to_dict()/resolved_dict() (written into checkpoints) depend on it.

    mode: str = knob(
        "quant", "codec",
        "The transport (docs/DESIGN.md section 4). quant: every entry on a block code; "
        "sparse: exactly k (offset, value) pairs per shard; auto: the same pairs, each "
        "message in its smallest coding (Elias-Fano, bitmap or dense); exact: bitmap plus "
        "a count sketch the owner peels, lossless; paper: the paper's Algorithm 1; dense: "
        "no compression.",
        values=" | ".join(MODES), reads="every route")
    theta: Optional[float] = knob(
        None, "codec",
        "Sparsity: the fraction of each shard's entries not sent, "
        "k = ceil((1 - theta) * S) kept per shard and rank.",
        values="[0, 1); quant: 0 only", reads="paper, exact, sparse, auto",
        derived="from ratio in paper mode (2 -> 0.80, 4 -> 0.90, 10 -> 0.9875), 0 in "
                "quant, else 0.9875")
    ratio: Optional[float] = knob(
        None, "codec",
        "The paper's sketch size: ceil(S / ratio) buckets per shard.",
        values=">= 1 in paper mode, None elsewhere", reads="paper",
        derived="from theta when it is a paper preset, else 10")
    index_bits: int = knob(
        1, "codec",
        "Lane width of the index all-reduce, bits per position (the paper uses 1 and 4; "
        "1-bit lanes lose entries to carries, counted in stats()).",
        values="1 | 2 | 4 | 8", reads="paper")
    value_dtype: Any = knob(
        torch.float32, "codec",
        "dtype of sketch buckets and sparse values on the wire (auto uses the gradient's "
        "where that is narrower).",
        values="float32 | bfloat16", reads="paper, exact, sparse, auto")
    layers: LayerPolicy = knob(
        "all", "selection",
        "Which parameters are compressed: all (every parameter of at least min_numel "
        "elements), non_attention (the paper's: Linear/Conv1D/Embedding weights but "
        "attention input projections, select_parameter), or a callable (module_name, module, "
        "param_name, param) -> bool.",
        values="all | non_attention | callable", reads="every compressing mode")
    min_numel: int = knob(
        2 ** 16, "selection",
        "The smallest parameter the built-in policies compress.",
        values=">= 0", reads="every compressing mode")
    error_feedback: bool = knob(
        True, "feedback",
        "Keep a per-rank residual of what each unit did not send and add it back at "
        "the next step.",
        values="bool", reads="every compressing mode")
    seed: int = knob(
        0, "codec",
        "Base of the sketch hash seeds: _tagc.seed_derive(seed, unit, step).",
        values="[0, 2^64)", reads="paper, exact")
    residual_dtype: Any = knob(
        torch.float32, "feedback",
        "Residual storage as values (residual_code none): bfloat16 halves the memory and "
        "rounds the feedback.",
        values="float32 | bfloat16", reads="every compressing mode with feedback")
    residual_code: Optional[str] = knob(
        None, "feedback",
        "How the residual is kept between calls: none (residual_dtype values) or block "
        "codes of quant_block entries, decoded into an fp32 working copy for a call; what "
        "the coding rounds away is dropped. Needs residual_dtype float32 and no ef21. "
        "Memory: tagc.memory.",
        values=" | ".join(RESIDUAL_CODES), reads="every compressing mode with feedback",
        derived="int4 in quant mode with the fp32 residual feedback, else none")
    residual_factor: Optional[float] = knob(
        None, "feedback",
        "The fraction of the residual a compressed call adds back (the rest is dropped): "
        "1 the classic error feedback, 0 none. Below 1 the optimizer's error per call is "
        "f e - e' instead of e - e', while (1 - f) of the rounding bias stays "
        "(docs/RESULTS.md, Feedback). The to-the-owner residual only.",
        values="[0, 1]", reads="every compressing mode with the residual feedback",
        derived="0.5 in quant mode with the residual feedback (its residual is rounding "
                "error), else 1 (top-k's holds the entries it did not send)")
    sketch_factor: float = knob(
        1.3, "codec",
        "Sketch buckets per possible union entry, m = ceil(sketch_factor * min(S, N*k)); "
        "3-hash peeling needs about 1.23, values below force peeling failures.",
        values="finite > 0", reads="exact")
    dense_steps: int = knob(
        0, "schedule",
        "The first dense_steps reductions of every compressed unit take the plain "
        "reduce-scatter (PowerSGD's start_powerSGD_iter). A reduction is one hook call per "
        "unit: one optimizer step under gradient accumulation.",
        values=">= 0", reads="every compressing mode")
    warmup_steps: int = knob(
        0, "schedule",
        "After the dense steps, the sparsity rises from warmup_theta to theta over this "
        "many reductions, the density falling geometrically (DGC's warm-up; theta_at).",
        values=">= 0; 0 in quant and paper", reads="exact, sparse, auto")
    warmup_theta: float = knob(
        0.75, "schedule",
        "The sparsity at the start of the warm-up.",
        values="[0, theta] with warmup_steps, else [0, 1)", reads="exact, sparse, auto")
    quant_format: str = knob(
        "int4", "codec",
        "Code per value (csrc/tagc.h): int8 (255 levels), int4 (15), ternary (5 codes per "
        "byte, byte-aligned: 1.625 bits at ``quant_block`` 256), sign (1 bit) or tls "
        "(ternary, a 4-bit log scale per 32 under an 8-bit one per 512: 1.74 bits, any "
        "quant_block). Sent per parameter and rank at N=2, int4: 2.25 at block 64, 2.06 "
        "at 256; ternary: 0.88 at 256; tls: 0.87, scales included (tagc.codec.quant_bytes).",
        values=" | ".join(QUANT_FORMATS), reads="quant")
    quant_block: int = knob(
        64, "codec",
        "Entries per fp32 scale of quant's codes, the HSDP owners' and residual_code's: "
        "64 keeps the gap to plain level with training length where 256's grew (RESULTS). "
        "A block at which a code in use takes 32 bits or more per value is refused, 16 "
        "or more warned about (check_block_codes).",
        values="[1, 65536]", reads="quant; residual_code")
    ef21: Optional[bool] = knob(
        None, "feedback",
        "EF21 instead of the residual: each rank keeps h, its estimate of its gradient, "
        "and sends C(g - h); each owner hands the sum of the ranks' h to the optimizer. "
        "State: an fp32 h per rank plus one fp32 shard. Needs error_feedback, an fp32 "
        "residual and residual_code none (docs/DESIGN.md section 5).",
        values="bool", reads="every compressing mode", derived="False")
    ef21_damping: Optional[bool] = knob(
        None, "feedback",
        "EF21 with a damped estimate: every h is first scaled by one factor "
        "``lam = clip(sum(g * h) / sum(h * h), 0, 1)``, pooled over the ranks, so noise "
        "coded as signal is not fed back (lam near 0 where consecutive gradients are "
        "independent). True needs ef21.",
        values="bool", reads="every compressing mode with ef21", derived="ef21")
    bypass_every: int = knob(
        0, "schedule",
        "Every P-th reduction of a compressed unit takes the other path and is timed; "
        "the ranks keep compressing only while that is not slower (tagc/bypass.py). A "
        "bypassed call sends g + residual plainly. 0: always compress.",
        values="0 or >= 2", reads="every compressing mode")
    gather: str = knob(
        "none", "gather",
        "How each unit's parameters travel in FSDP's all-gathers: none (FSDP's exact "
        "gather) or block codes of gather_block weights every rank decodes alike, the "
        "masters and the optimizer untouched (ZeRO++'s qwZ). Every unit, not only the "
        "layers selection; a block holding NaN/Inf gathers its unit exactly (CPU).",
        values=" | ".join(GATHER_FORMATS), reads="FSDP2, every mode")
    gather_block: int = knob(
        256, "gather",
        "Weights per scale of the gather codes (fp32 scales for int8/int4, power-of-two "
        "bytes for fp4); bounded as quant_block, fp4: a power of two up to 256.",
        values="[1, 65536]; fp4: 2, 4, .., 256", reads="FSDP2 with gather")
    gather_rotate: bool = knob(
        False, "gather",
        "fp4 gathers: a random Hadamard rotation of each block before coding, undone "
        "after decoding (the same seeded signs on every rank and call of a unit), which "
        "spreads a block's outliers (NVFP4 pretraining, QuaRot).",
        values="bool", reads="FSDP2 with gather: fp4")
    gather_delta: bool = knob(
        False, "gather",
        "int8/int4 gathers code each weight's change since the gathered weights every "
        "rank holds (SDP4Bit), an error of a fraction of one step's update. Memory: every "
        "rank keeps the unsharded model in the gather dtype and its shard as last sent. "
        "First calls and those after a TAGC state load are exact; on CPU tensors a "
        "backward re-gather sends the changed flags, codes only if a shard moved.",
        values="bool", reads="FSDP2 with gather: int8 | int4")
    fsdp_overlap: bool = knob(
        True, "overlap",
        "Run every unit's reduce-scatter and parameter all-gather on a worker thread while "
        "the forward and backward compute, gathers one unit ahead (tagc/overlap.py); the "
        "values of False bit for bit. Issue no other collectives on the shard group "
        "meanwhile.",
        values="bool", reads="FSDP2 over one group, CPU tensors")
    guard_ratio: Optional[float] = knob(
        None, "feedback",
        "The feedback guard: the ranks pool ``|g - h|^2`` (EF21) or ``|residual|^2`` over "
        "``|g|^2`` of the unit; above guard_ratio the call takes the plain reduce-scatter, "
        "which settles the state (guard_resets). None: DEFAULT_GUARD_RATIO with ef21 on "
        "the CPU, else off; 0: off; > 0 raises NotImplementedError on CUDA.",
        values="None, 0 or finite > 0 (needs feedback)", reads="every compressing mode")
    hsdp_allreduce: str = knob(
        "auto", "hsdp",
        "The compressed all-reduce's form: two_phase (chunk j of every shard to replica "
        "j, which codes its chunk of the sum and all-gathers it) or gather (every coded "
        "shard to every replica; not exact/paper); auto picks by bytes "
        "(tagc.hsdp.allreduce_form).",
        values=" | ".join(HSDP_ALLREDUCE_FORMS), reads="custom HSDP")
    hsdp_out_format: str = knob(
        "auto", "hsdp",
        "The code of each owner's chunk of the sum in two-phase's to-everyone phase; "
        "auto: int4 after sign or ternary (a sum of R codes has many levels), else "
        "quant_format.",
        values="auto | " + " | ".join(QUANT_FORMATS), reads="custom HSDP, quant, two-phase")
    hsdp_overlap: bool = knob(
        True, "overlap",
        "Run each unit's all-reduce between the nodes on a worker thread while the "
        "backward computes the next units; the values of False bit for bit.",
        values="bool", reads="custom HSDP, CPU tensors")
    outer_every: int = knob(
        0, "local",
        "H: each node takes H steps with plain FSDP inside it, then each rank's shard "
        "change goes through the compressed all-reduce and a Nesterov outer step moves "
        "the round's start. 0: every backward all-reduces. Needs register(..., "
        "optimizer=).",
        values=">= 0", reads="custom HSDP")
    outer_lr: float = knob(
        0.7, "local", "The outer step's learning rate.",
        values="finite > 0", reads="custom HSDP with outer_every")
    outer_momentum: float = knob(
        0.9, "local", "The outer step's Nesterov momentum.",
        values="[0, 1)", reads="custom HSDP with outer_every")
    outer_fragments: int = knob(
        1, "local",
        "P: the units split into P fragments of about equal size, fragment p synced at "
        "inner steps p * H // P + k * H (Streaming DiLoCo).",
        values="[1, outer_every]", reads="custom HSDP with outer_every")
    outer_overlap: int = knob(
        0, "local",
        "tau: a fragment's all-reduce runs on a worker thread, its outer step applied "
        "tau inner steps later.",
        values="0 <= tau < outer_every // outer_fragments",
        reads="custom HSDP with outer_every")
    outer_mix: float = knob(
        0.0, "local",
        "alpha: at its outer step a fragment's shard becomes (1 - alpha) * global + "
        "alpha * local; 0 keeps the replicas identical.",
        values="[0, 1)", reads="custom HSDP with outer_every")

    def __post_init__(self) -> None:
        # which derived knobs the caller gave: to_dict() writes the others as None
        object.__setattr__(self, "_given", frozenset(
            n for n in DERIVED if getattr(self, n) is not None))
        for group, _, _ in GROUPS:
            CHECKS[group](self)
        check_block_codes(coded_pairs(self))

    @classmethod
    def describe(cls, markdown: bool = False) -> str:
        """Every knob by group: what it does, its default, its values, what reads it.

        Args:
            markdown: a markdown reference (docs/USAGE.md's) instead of plain text.
        Returns:
            the text.
        """
        out: List[str] = []
        for group, title, what in GROUPS:
            out += [f"### {title}" if markdown else f"{title}: {what}.", ""]
            if markdown:
                out += [f"{what[0].upper()}{what[1:]}.", ""]
            for f in dataclasses.fields(cls):
                if f.metadata.get("group") == group:
                    out += _describe_knob(f, markdown)
            out.append("")
        return "\n".join(out).rstrip("\n") + "\n"

    # -- what the mode implies (one place, instead of mode strings across the package)
    @property
    def compresses(self) -> bool:
        """True unless ``mode == "dense"`` (which sends every value plainly)."""
        return self.mode != "dense"

    @property
    def quantizes(self) -> bool:
        """True for ``mode == "quant"``: every entry on a block code, theta 0."""
        return self.mode == "quant"

    @property
    def top_k(self) -> bool:
        """True for the modes that send each rank's top-k entries of a shard
        (``paper``, ``exact``, ``sparse``, ``auto``)."""
        return self.mode in ("paper", "exact", "sparse", "auto")

    @property
    def sketched(self) -> bool:
        """True for ``exact`` and ``paper``: positions on bitmaps/lanes plus a count
        sketch, whose union of ranks' entries needs an owner (HSDP: two-phase only)."""
        return self.mode in ("exact", "paper")

    @property
    def pairs(self) -> bool:
        """True for ``sparse`` and ``auto``: (offset, value) pairs per shard."""
        return self.mode in ("sparse", "auto")

    @property
    def feeds_back(self) -> bool:
        """True when a compressing mode keeps feedback state (``error_feedback``)."""
        return self.compresses and self.error_feedback

    def out_format(self) -> str:
        """The quant code of two-phase HSDP's to-everyone phase (``hsdp_out_format``
        resolved): ``"auto"`` is ``int4`` after ``sign``/``ternary``/``tls``, else
        ``quant_format``."""
        if self.hsdp_out_format != "auto":
            return self.hsdp_out_format
        return "int4" if self.quant_format in ("sign", "ternary", "tls") else self.quant_format

    def guard_threshold(self, device: torch.device) -> float:
        """The feedback guard's threshold for a unit reduced on ``device`` (0: off).

        Args:
            device: where the unit's gradient is reduced.
        Returns:
            ``guard_ratio``, or with ``None`` ``DEFAULT_GUARD_RATIO`` under EF21 on
            the CPU and 0 otherwise.
        Raises:
            NotImplementedError: an explicit ``guard_ratio > 0`` on a CUDA device.
        """
        cuda = torch.device(device).type == "cuda"
        if self.guard_ratio is None:
            return DEFAULT_GUARD_RATIO if self.ef21 and not cuda and \
                self.mode != "dense" and self.error_feedback else 0.0
        if self.guard_ratio > 0 and cuda:
            raise NotImplementedError(
                "guard_ratio: the feedback guard is implemented on the CPU only; on CUDA "
                "choosing the plain reduce-scatter would need its decision on the host (a "
                "sync per call). Set guard_ratio=0 (or leave it None: off on CUDA)")
        return self.guard_ratio

    def theta_at(self, step: int) -> Optional[float]:
        """Sparsity of a unit's reduction number ``step`` (0-based) under the warm-up.

        Args:
            step: how many reductions of the unit came before (dense ones included).
        Returns:
            None while ``step < dense_steps`` (plain reduce-scatter), else the
            sparsity: ``warmup_theta`` rising to ``theta`` with density
            ``(1-warmup_theta) * ((1-theta)/(1-warmup_theta)) ** (j/warmup_steps)``
            at warm-up step ``j``, then ``theta``.
        """
        if step < self.dense_steps:
            return None
        j = step - self.dense_steps
        if j >= self.warmup_steps:
            return self.theta
        d0, d1 = 1.0 - self.warmup_theta, 1.0 - self.theta
        return 1.0 - d0 * (d1 / d0) ** (j / self.warmup_steps)

    def kept(self, step: int, s: int) -> int:
        """Entries kept per shard of ``s`` at reduction ``step`` (warm-up schedule).

        Args:
            step: the unit's reduction number (not one of the dense steps).
            s: shard length.
        Returns:
            :func:`keep_count` of the step's sparsity.
        """
        theta = self.theta_at(step)
        assert theta is not None  # dense steps never reach the codecs
        return keep_count(theta, s)

    # -- (de)serialisation
    def to_dict(self) -> Dict[str, Any]:
        """Plain-data view (dtypes as names, a callable policy as its qualified name),
        with the derived knobs that were not given as None, so they follow their
        source again when the dict is changed and loaded.

        Returns:
            dict accepted by :meth:`from_dict` (except for callable ``layers``).
        """
        d = self.resolved_dict()
        for name in DERIVED:
            if name not in self._given:
                d[name] = None
        return d

    def resolved_dict(self) -> Dict[str, Any]:
        """Every knob as used (derived ones resolved), plain data: what checkpoints
        record and ranks compare.

        Returns:
            the dict.
        """
        d = dataclasses.asdict(self)
        d["value_dtype"] = str(self.value_dtype).replace("torch.", "")
        d["residual_dtype"] = str(self.residual_dtype).replace("torch.", "")
        if callable(self.layers):
            d["layers"] = "callable:" + getattr(self.layers, "__qualname__",
                                                type(self.layers).__name__)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TAGCConfig":
        """Build a config from a mapping; unknown keys raise.

        Args:
            d: mapping of field names to values.
        Returns:
            the validated config.
        """
        return _from_mapping(cls, d, "config")

    def replace(self, **changes: Any) -> "TAGCConfig":
        """A copy with ``changes`` applied; derived knobs that were not given follow
        them (``cfg.replace(ef21=False)`` on ``tagc-balanced`` drops the damping too).

        Args:
            **changes: field names and values.
        Returns:
            the validated config.
        """
        # layers itself, not to_dict()'s name of a callable policy
        return self.from_dict({**self.to_dict(), "layers": self.layers, **changes})

    @classmethod
    def preset(cls, name: str, overrides: Optional[Dict[str, Any]] = None) -> "TAGCConfig":
        """A shipped preset by name: ``"balanced"`` (= ``TAGCConfig()``), ``"full"``,
        ``"lean"``, ``"tagc-auto"``, ... (``tagc.presets.names()``), or a YAML file.

        Args:
            name: the preset's name, with or without ``tagc-``, or a path.
            overrides: fields replacing the file's (see :meth:`from_yaml`).
        Returns:
            the validated config.
        Raises:
            ValueError: no such preset (the message lists them), or a bad field.
        """
        from tagc import presets

        path = presets.resolve(name)
        if path.name.startswith(presets.PIPELINE_PREFIX):
            raise ValueError(f"{path.name} is a pipeline preset: load it with "
                             "tagc.pipeline.PipelineConfig.from_yaml (train_gpt2.py --pp)")
        return cls.from_yaml(str(path), overrides)

    @classmethod
    def from_yaml(cls, path: str, overrides: Optional[Dict[str, Any]] = None) -> "TAGCConfig":
        """Load a YAML preset (e.g. ``configs/tagc-10x-1bit.yaml``); unknown keys raise.

        Args:
            path: YAML file holding a mapping of field names to values.
            overrides: fields replacing the file's.  They apply before the defaults
                resolve, so a knob whose default follows another follows the override
                (``ef21_damping`` follows ``ef21``): ``{"ef21": False}`` on an EF21
                preset gives a config without EF21, not a conflict.
        Returns:
            the validated config.
        """
        from tagc.presets import load_mapping

        return cls.from_dict({**load_mapping(path), **(overrides or {})})

    def fingerprint(self) -> str:
        """Stable digest of the config, compared across ranks at register()."""
        return hashlib.sha256(json.dumps(self.resolved_dict(), sort_keys=True)
                              .encode()).hexdigest()


# Knobs whose default follows other knobs (resolved by their group's check); to_dict()
# writes them as None unless given, so a changed source re-derives them.
DERIVED = tuple(f.name for f in dataclasses.fields(TAGCConfig) if f.metadata["derived"])


def _default_text(f: "dataclasses.Field[Any]") -> str:
    """A knob's default as the docs write it."""
    if f.metadata["derived"]:
        return f"derived: {f.metadata['derived']}"
    v = f.default
    return str(v).replace("torch.", "") if isinstance(v, torch.dtype) else repr(v)


def _describe_knob(f: "dataclasses.Field[Any]", markdown: bool) -> List[str]:
    """One knob's entry: name, default, values and readers, then its doc.

    Args:
        f: the field.
        markdown: a markdown list item instead of indented text.
    Returns:
        the lines.
    """
    m = f.metadata
    if markdown:
        return textwrap.wrap(f"- `{f.name}` (default {_default_text(f)}; {m['values']}; "
                             f"read by {m['reads']}): {m['doc']}", 88,
                             subsequent_indent="  ", break_on_hyphens=False)
    head = textwrap.wrap(f"{f.name} (default {_default_text(f)}; {m['values']}; read by "
                         f"{m['reads']})", 88, initial_indent="    ",
                         subsequent_indent="            ", break_on_hyphens=False)
    return head + textwrap.wrap(m["doc"], 88, initial_indent="        ",
                                subsequent_indent="        ", break_on_hyphens=False)


TAGCConfig.__doc__ = "\n\n".join(
    textwrap.fill(" ".join(par.split()), 88, break_on_hyphens=False)
    for par in _DOC_HEAD.format(derived=", ".join(DERIVED)).split("\n\n")) + "\n\n" + \
    TAGCConfig.describe()

# The knob reference in docs/USAGE.md sits between these lines.
USAGE_BEGIN = "<!-- knobs: generated from tagc/config.py by tagc.config.write_knobs_doc() -->"
USAGE_END = "<!-- knobs: end -->"


def write_knobs_doc(path: str = "docs/USAGE.md", check: bool = False) -> bool:
    """Write :meth:`TAGCConfig.describe` (markdown) between the knob markers of ``path``.

    Args:
        path: the markdown file holding ``USAGE_BEGIN`` and ``USAGE_END``.
        check: compare only, writing nothing.
    Returns:
        True when the file already held the generated text.
    Raises:
        ValueError: the markers are missing or out of order.
    """
    with open(path) as fh:
        text = fh.read()
    i, j = text.find(USAGE_BEGIN), text.find(USAGE_END)
    if i < 0 or j < i:
        raise ValueError(f"{path}: needs the lines {USAGE_BEGIN!r} and then {USAGE_END!r}")
    new = text[:i + len(USAGE_BEGIN)] + "\n\n" + TAGCConfig.describe(markdown=True) + \
        "\n" + text[j:]
    if new != text and not check:
        with open(path, "w") as fh:
            fh.write(new)
    return new == text
