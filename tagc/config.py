"""TAGCConfig: every knob of TAGC, documented and validated (the tuning guide).

``TAGCConfig()`` is the recommended preset, ``tagc-balanced`` (mode ``quant``, int4
codes on every layer, residual feedback kept on int4 codes: about 8x fewer gradient bytes than FSDP's reduce-scatter for
the same model), as PyTorch's ``PowerSGDState`` defaults are its recommendation; the
other shipped presets load by name, ``TAGCConfig.preset("full")`` (int8 parameter
gathers too, FSDP2) or ``TAGCConfig.preset("lean")`` (ternary codes, no feedback state:
about 18x fewer).  The top-k modes
(``exact``, ``sparse``, ``paper``) send far fewer bytes at the paper's sparsity but
train AdamW models measurably worse; docs/DESIGN.md section 8 has the numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.nn as nn

MODES = ("paper", "exact", "sparse", "auto", "quant", "dense")
QUANT_FORMATS = ("sign", "ternary", "int4", "int8")
# Code density of each quant format, bits per value (scales excluded): ternary packs
# 5 codes per byte.  Each block's codes start on a fresh byte, so the wire cost per
# value depends on the block (ternary: 1.625 at 256, since 256 codes take 52 bytes);
# the exact size of a shard is `_tagc.quant_bytes(n, format, block)`, which every
# transport sizes its messages by.
QUANT_BITS = {"sign": 1.0, "ternary": 1.6, "int4": 4.0, "int8": 8.0}
# Parameter all-gather formats (FSDP2): "none" leaves FSDP's own all-gather alone.
GATHER_FORMATS = ("none", "int8", "int4")
HSDP_ALLREDUCE_FORMS = ("auto", "two_phase", "gather")
# How a residual is kept between calls (TAGCConfig.residual_code): "none" as values of
# residual_dtype, or as block codes.
RESIDUAL_CODES = ("none", "int8", "int4")
# The paper's compression presets: ratio -> sparsity (Table/Section 4 of the paper).
PAPER_THETA: Dict[float, float] = {2.0: 0.80, 4.0: 0.90, 10.0: 0.9875}
# The feedback guard's threshold when guard_ratio is left at None and EF21 is on
# (docs/DESIGN.md section 5, "When feedback drifts"): healthy EF21 runs peaked at 68
# (tiny GPT-2, int4, the end of its LR warm-up) and 8.3 (teacher-student), a state
# corrupted on one rank reads 1e6 and more; 256 leaves about 4x room above the former.
DEFAULT_GUARD_RATIO = 256.0
# Knobs whose default follows other knobs (resolved in __post_init__); to_dict() writes
# them as None unless given, so a changed source re-derives them.
DERIVED = ("theta", "ratio", "ef21", "ef21_damping", "residual_code")
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
    from .codec import _tagc, require_codec

    require_codec()
    if gather:
        nbytes = _tagc.wq_bytes(torch.tensor([block], dtype=torch.int64), fmt, block)
    else:
        nbytes = _tagc.quant_bytes(block, fmt, block)
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


# --------------------------------------------------------------------------- config

@dataclass
class TAGCConfig:
    """Every knob of TAGC, validated on construction; the defaults are ``tagc-balanced``.

    Knobs whose default follows another (``theta``, ``ratio``, ``ef21``,
    ``ef21_damping``: "derived") keep following it unless given: :meth:`to_dict` writes
    a derived knob that was not given as None, so ``TAGCConfig.from_dict({**c.to_dict(),
    "mode": "exact"})`` re-derives them for the new mode, and :meth:`replace` applies
    changes that way; :meth:`resolved_dict` has every value as used.

    Args:
        mode: transport (default ``"quant"``) (docs/DESIGN.md section 4). ``"paper"``: the paper's
            Algorithm 1, index all-reduce SUM on ``index_bits`` lanes plus a
            fixed ``S/ratio`` sketch per shard reduced to its owner (1-bit
            lanes lose entries to carries; reported in stats). ``"exact"``:
            bitmap all-to-all with a true OR at the owner, sketch sized from
            the union bound, lossless (a recovery exchange resolves entries
            peeling leaves). ``"sparse"``: exactly ``k`` (offset, value) pairs
            per shard in one all-to-all. ``"auto"``: the same pairs as
            ``sparse`` (lossless: every owner gets the exact sum of every
            rank's top-k), each shard's message in the coding of fewest bytes
            for (S, k, value dtype), chosen by every rank from sizes alone:
            Elias-Fano positions (about 2 + log2(S/k) bits each instead of
            32), a bitmap, or dense values; never more bytes than the plain
            reduce-scatter, at any theta; ``stats()`` counts the codings
            (``coded_ef``/``coded_bitmap``/``coded_dense``). ``"quant"``: every entry of a shard,
            each on a few bits (``quant_format``) with one fp32 scale per
            ``quant_block`` entries, with error feedback of the rounding; the
            owner's own shard stays exact.  ``"dense"``: no compression, values
            all-to-all to their owner (the honest gloo baseline).
        theta: sparsity in ``[0, 1)``: fraction of each shard's entries not
            sent; ``k = ceil((1 - theta) * S)`` kept per shard per rank.
            Default: from ``ratio`` in paper mode (2x->0.80, 4x->0.90,
            10x->0.9875), 0 in quant mode (which sends every entry and
            refuses any other value), else 0.9875.  Ignored by ``dense``.
        ratio: paper mode only: sketch size is ``ceil(S / ratio)`` buckets.
            Default in paper mode: from ``theta`` when it is a paper preset,
            else 10.  Must be None in other modes.
        index_bits: paper mode lane width, 1, 2, 4 or 8 bits per position
            (the paper uses 1 and 4).
        value_dtype: dtype of sketch buckets and sparse values on the wire,
            ``torch.float32`` or ``torch.bfloat16`` (``auto`` uses the
            gradient's dtype where that is narrower).
        layers: which parameters are compressed: ``"all"`` (default: every
            parameter with >= ``min_numel`` elements; block quantization does
            not hurt attention inputs the way top-k does, docs/RESULTS.md),
            ``"non_attention"`` (the paper's: ``nn.Linear``/``nn.Embedding``
            weights that are not attention QKV projections, see
            :func:`select_parameter`; the top-k presets use it), or a callable
            ``(module_name, module, param_name, param) -> bool``.
        min_numel: smallest parameter compressed by the built-in policies.
        error_feedback: keep per-rank, per-unit residuals of what was not sent
            and add them back next step.
        seed: base of the sketch hash seeds, ``_tagc.seed_derive(seed, unit, step)``.
        residual_dtype: residual storage, ``torch.float32`` (default) or
            ``torch.bfloat16`` (halves the memory, rounds the feedback).
        residual_code: how the residual is kept between calls: ``"none"`` as
            ``residual_dtype`` values; ``"int8"`` / ``"int4"`` as block codes of ``quant_block`` entries (round to nearest,
            one fp32 scale per block; LoCo keeps an 8-bit error buffer, arXiv
            2407.04480), decoded into an fp32 working copy for the length of a
            call and coded again after it; what that coding rounds away is
            dropped, not fed back (a fraction of a residual that is itself a
            fraction of the gradient).  Memory per rank and entry of a unit:
            ``quant_bytes(n)/n`` bytes (int8 1.016, int4 0.516 at block 256)
            instead of 4, plus the working copy during a call (transient,
            one unit).  ``None`` (default): ``"int4"`` for ``quant`` mode's
            residual feedback (``tagc-balanced``/``tagc-full``: 0.52 bytes per
            parameter per rank, level with an fp32 residual and with EF21 on the
            suite, docs/SUITE.md), ``"none"`` for the top-k modes (their
            residual holds most of what they do not send; measured with fp32),
            for EF21 (``h`` must match the owner's sum exactly) and for a
            ``bfloat16`` ``residual_dtype``.  A code needs ``residual_dtype``
            float32 and no EF21; it has no effect where no residual is kept
            (``error_feedback`` off, ``dense``).  Memory of every state:
            ``tagc.memory``.
        sketch_factor: exact mode: buckets per possible union entry,
            ``m = ceil(sketch_factor * min(S, N*k))``; 3-hash peeling needs
            about 1.23.  Values below that force peeling failures (used by
            the tests of the recovery exchange).
        dense_steps: the first ``dense_steps`` reductions of every compressed
            unit go through the plain reduce-scatter (no residual yet), as
            PowerSGD's ``start_powerSGD_iter``: early gradients are large and
            change fast, and error feedback cannot make up for what is
            dropped while the loss falls steeply.  A reduction is one call
            of the hook per unit, i.e. one optimizer step with gradient
            accumulation (``no_sync``).  0: compress from the first step.
        warmup_steps: after the dense steps, ``exact``, ``sparse`` and ``auto`` ramp the
            sparsity from ``warmup_theta`` to ``theta`` over this many
            reductions, the density falling geometrically as in DGC's
            warm-up (Lin et al. 2018: 75%, 93.75%, ... sparsity); the wire
            bytes follow the density.  0: ``theta`` from the start.  Not in
            ``paper`` mode, whose sketch is a fixed ``S/ratio`` sized for
            ``theta`` (a denser start would overflow it).
        warmup_theta: sparsity at the start of the warm-up, in ``[0, theta]``
            when ``warmup_steps > 0`` (unused otherwise).
        quant_format: quant mode's code per value (``csrc/tagc.h``):
            ``"int8"`` (255 levels of max|v|/127, 8 bits), ``"int4"`` (15
            levels of max|v|/7, 4 bits), ``"ternary"`` ({-s, 0, +s} with
            ``s = min(2.5 mean|v|, max|v|)``, 5 codes per byte, each
            block's codes byte-aligned: 1.625 bits at ``quant_block`` 256) or
            ``"sign"`` (+-mean|v|, 1 bit).  Why it works where top-k
            struggles: every coordinate reaches the optimizer every step, so
            AdamW's per-coordinate moments see a stream like plain training,
            not bursts every 1/density steps (docs/DESIGN.md section 8).
            Cost per rank and step: ``(N-1)/N * 8 * quant_bytes(S) / S`` bits
            per parameter of the compressed units, ``quant_bytes`` being
            ``_tagc.quant_bytes(S, quant_format, quant_block)`` (the exact
            wire size of a shard of S, scales included; N=2, block 256,
            int4: 2.06; ternary: 0.88; tests/test_hook_config.py checks these
            figures against it); memory: one residual per unit as every mode.
        quant_block: entries per fp32 scale in quant mode, 1..65536 (256:
            0.125 bits per entry of scale).  A block at which a code in use
            (``quant_format``, the HSDP owners', ``residual_code``) takes 32
            bits or more per value is refused, 16 or more warned about
            (:func:`check_block_codes`): blocks 1 to 4, depending on the code.
        ef21: EF21 feedback (Richtarik et al. 2021) instead of the residual:
            each rank keeps ``h``, its running estimate of its own gradient,
            and sends the compressed *change* ``C(g - h)`` (then ``h += C(g -
            h)``); each owner keeps the sum of every rank's ``h`` for its
            shard (a dense estimate, ``est += what arrived``) and hands that
            to the optimizer every step.  Why: residual feedback delivers
            what it held back late, all at once, so the optimizer sees a
            delayed and bursty gradient; EF21's estimate follows the current
            gradient and is never owed anything (the README's quality grid
            has the ternary code with each feedback; docs/DESIGN.md sections
            5 and 8 the mechanism).  Cost: the same bytes; memory:
            the residual buffer holds ``-h`` (as before, one unit per rank)
            plus one fp32 estimate of the owner's shard (1/N of the unit).
            Needs ``error_feedback`` and an fp32 residual (``residual_code``
            ``"none"``, which it then derives: a rounded ``h`` would drift from
            the owner's sum); not in ``dense`` mode.  ``None`` (default): off.
            It was ``tagc-balanced``'s feedback until issue 42; its state, an
            unsharded fp32 copy of every unit per rank plus a shard, is 4(1 +
            1/N) bytes per parameter (31 GB per GPU at 7B on 8 GPUs), while the
            residual on int4 codes trains as well on the suite at 0.52
            (docs/SUITE.md).
        ef21_damping: EF21 with a damped estimate: each call first scales
            every rank's ``h`` and the owners' estimates by one factor
            ``lam = clip(sum <g, h> / sum ||h||^2, 0, 1)`` (sums over the
            unit and the ranks, pooled in the non-finite vote: the same
            ``lam`` everywhere, so the owners' estimates stay the sums of the
            ranks' ``h``), then sends ``C(g - lam h)``; ``h = lam h + C(g -
            lam h)``.  ``lam h`` is the multiple of ``h`` closest to ``g``
            (least squares over the unit), so the coded vector is never
            larger than ``g``: where consecutive gradients are nearly
            independent (small batches, noisy tasks) plain EF21 codes ``g -
            h`` with ``||g - h||^2 ~ 2 ||g||^2`` and keeps coding noise it
            took for signal; damping drops to ``lam ~ 0`` there (compression
            without feedback) and stays at ``lam ~ 1`` where the gradient
            persists (plain EF21).  docs/DESIGN.md section 5 has the
            measurements.  ``None`` (default): on with ``ef21``; ``False``:
            the undamped recursion; ``True`` needs ``ef21``.  Cost per call:
            two dot products over the unit, 32 more control bytes in the
            vote (the guard's sums share it), no memory, nothing in
            checkpoints (``lam`` is recomputed from the state every call).
        bypass_every: 0 (default): always compress.  ``P >= 2``: every P-th
            reduction of a compressed unit takes the other path (plain
            reduce-scatter or compression) and is timed; the ranks sum their
            mean times of both paths (16 bytes) and all keep compressing only
            while that is not slower (tagc/bypass.py).  For links where the
            codec may cost more than the bytes it saves (loopback, NVLink, a
            fast fabric).  Bypassed calls send ``g + residual`` plainly and
            empty the residual, so nothing owed is lost; counted in
            ``bypassed_calls``.  CUDA: one host sync per probe.  Not in
            ``dense`` mode.  Custom HSDP: the probe times the to-the-owner
            phase of the all-reduce (tagc/hsdp.py).
        gather: FSDP2 only: how each unit's *parameters* travel in FSDP's
            all-gathers (the forward gather and the backward re-gather, 2 of
            FSDP's 3 collectives).  ``"none"`` (default): FSDP's own exact
            all-gather.  ``"int8"`` / ``"int4"``: every rank block-quantizes
            its shard (round to nearest, ``max|w|/127`` or ``max|w|/7`` per
            block of ``gather_block`` values, blocks never crossing a
            parameter), one all-gather of codes + scales, and every rank, the
            owner included, dequantizes all shards, so every rank computes
            with the same weights, in forward and backward alike (the same
            masters give the same bytes).  The sharded parameters and the
            optimizer are untouched: only the gathered copy is quantized, the
            gradient is taken at it (straight through) and applied to the
            exact masters (ZeRO++'s qwZ, arXiv 2306.10209).  Applies to every
            unit (not only the ``layers`` selection: weights of attention and
            norms quantize as well as any, and every byte counts) whose
            all-gather dtype is fp32 or bf16.  A block holding NaN/Inf is never quantized:
            the whole unit is then gathered exactly on every rank (CPU); on
            CUDA the block decodes to NaN (the step fails loudly).
            :meth:`TAGCState.exact_gathers` gathers exactly, e.g. for
            validation.  Cost per rank and gather: ``(N-1)/N * (8 + 32/
            gather_block)`` bits per parameter for int8 (8.125 at block
            256), against 32 (fp32) or 16 (bf16 ``param_dtype``); memory:
            the codes of one unit, per call, nothing kept.
        gather_block: values per fp32 scale of the gather codes, 1..65536;
            bounded as ``quant_block`` (int8 from 5, int4 from 4 without a warning).
        fsdp_overlap: FSDP2 over one group on the CPU: run every unit's
            reduce-scatter and every parameter all-gather on a worker thread
            while the forward and backward compute (tagc/overlap.py), as FSDP's
            streams do on a GPU: the backward goes on while a unit's gradient
            travels, and each gather runs one unit ahead of its compute (FSDP's
            backward prefetch, and a forward prefetch TAGC sets from the first
            forward's order: one unit's gathered parameters more held at a time).
            Same operations in the same order on every rank: the values are
            those of ``False``, bit for bit.  A unit whose gradient FSDP reads
            right after the reduce-scatter (accumulation into an existing
            ``.grad``, a reduce dtype other than the parameters', CPU offload,
            post-accumulate-grad hooks) waits for its exchange, as with
            ``False``.  While a step runs, nothing else may issue collectives on
            the shard group (the worker's order is the ranks' agreement).  No
            effect on CUDA tensors (FSDP's streams overlap them), on FSDP1 or on
            TAGC's HSDP route (``hsdp_overlap``).
        guard_ratio: the feedback guard.  Every compressed call, each rank
            measures its feedback state against its gradient over the whole
            unit: with ``ef21`` the estimate error ``||g - h||^2`` (``h``
            before the call), with the residual feedback what it owes,
            ``||residual||^2``; the ranks sum these and ``||g||^2`` inside the
            non-finite vote (one all-reduce of 32 bytes instead of 4, no extra
            round), so every rank sees the same pooled ratio ``sum ||g -
            h||^2 / sum ||g||^2`` and takes the same path.  When it exceeds
            ``guard_ratio``, the call takes the plain reduce-scatter that
            settles the state, as a bypassed call does (EF21's estimates
            become the exact sums, the residual travels with the gradient):
            a state that no longer describes the gradient is dropped instead
            of being sent on.  Counted in ``guard_resets``.  Why a ratio of
            squared norms: it is what EF21's contraction argument bounds
            (``||C(x) - x||^2 <= (1 - alpha) ||x||^2``); a ratio of 1 means
            the estimate is no better than none, and a stochastic gradient
            already gives about 2 (consecutive gradients' noise is
            independent), with transients to about 70 where the gradient's
            norm falls fast, which is why the default sits well above that:
            it catches a state that has gone bad (corrupted, stale, another
            loss scale), not the steady cost of a coarse code.
            ``None`` (default): ``DEFAULT_GUARD_RATIO`` (256) with ``ef21``
            where the guard exists (CPU), off elsewhere and with
            the residual feedback, whose healthy level depends on the code
            (about ``1/density`` for top-k).  ``0``: off.  A number > 0:
            that threshold; it needs error feedback and a compressing mode,
            and raises NotImplementedError on CUDA (the decision would have
            to reach the host to pick the collective).  Custom HSDP: it
            watches the to-the-owner phase's state.
            Cost per call: three dot products over the unit and 28 more
            control bytes, shared with ``ef21_damping``'s.
        hsdp_allreduce: custom HSDP only: the form of the compressed all-reduce
            between the R replicas (tagc/hsdp.py).  ``"two_phase"``: chunk j of
            every replica's shard, coded, to replica j, which sums, codes its
            chunk of the sum with a feedback state of its own and all-gathers
            it: about 2(R-1)/R coded shards per rank, flat in R.
            ``"gather"``: every replica's whole coded shard to every replica:
            R-1 coded shards per rank, each contribution coded once; not for
            ``exact``/``paper`` (NotImplementedError).  ``"auto"`` (default):
            always two-phase for ``exact``/``paper``; for ``quant`` two-phase
            where it sends fewer bytes, counted on the unit's codes (from 3
            replicas with one code, from 4 for ternary with int4 owners, see
            ``hsdp_out_format``), for ``sparse``/``auto`` from 3 replicas on;
            all-gather at 2 replicas (equal bytes, one coding fewer) and for
            ``dense`` (one plain all-reduce, bit for bit native HSDP).
            Memory of two-phase: the owner's ``residual_out``, 1/R of the
            shard (residual feedback), or with ``ef21`` ``estimate_out``, every
            owner's estimate (one shard), checkpointed like the rest.
        hsdp_out_format: quant mode, two-phase HSDP only: the code of each
            owner's chunk of the sum in the to-everyone phase (what every
            replica decodes), one of ``QUANT_FORMATS`` or ``"auto"`` (default):
            ``int4`` when ``quant_format`` is ``sign`` or ``ternary``, else
            ``quant_format``.  Why: the owner's chunk is a sum of R decoded
            codes plus its own exact share, a many-level signal that a second
            ternary code cuts to three levels.  Measured at R = 4 on the tiny
            GPT-2 after 1000 steps (docs/DESIGN.md section 9): ternary with
            EF21 (the ``lean`` preset then) +4.63% against native HSDP with
            ternary owners, +2.12% with int4 owners (hook runs made before the
            one-rank-per-node divide fix, RESULTS.md; the probe's 0.50 vs 0.20
            squared error, DESIGN section 9, is unaffected).  Cost: about (R-1)/R * (b + b_out) bits per
            element of the shard, b and b_out the two codes' bits, which
            ``hsdp_allreduce="auto"`` weighs against the all-gather form's.
        hsdp_overlap: custom HSDP on the CPU: run each unit's all-reduce between
            the nodes on a worker thread while the backward computes the next
            units (tagc/overlap.py), as FSDP's all-reduce stream does on a GPU;
            the backward still returns with every gradient summed, bit for bit
            the values of a blocking hook.  A unit whose gradient FSDP reads
            right after the hook (accumulation into an existing ``.grad``, a
            reduce dtype other than the parameters', CPU offload,
            post-accumulate-grad hooks) blocks, as with ``False``.  Measured on
            the step benchmark's 200 Mbit link (docs/RESULTS.md, three A/B
            pairs): steps 10% (``balanced``) and 6% (``lean``) shorter at 2 nodes
            with a core per rank; level within the noise (3% shorter on
            average) at 4 nodes sharing 2 cores, where the exchange needs the
            cores the backward holds.  No effect on CUDA tensors (FSDP's
            streams overlap them) or without HSDP.
        outer_every: custom HSDP only: local steps (DiLoCo, arXiv 2311.08105;
            tagc/local.py).  0 (default): every backward all-reduces between the
            nodes.  ``H >= 1``: each node takes H steps of the user's optimizer
            with plain FSDP inside the node (gradients averaged over the node's
            ranks, nothing between nodes), then an outer step: each rank's shard
            change since the round began (the pseudo-gradient) goes through this
            config's compressed all-reduce between the replicas (``mode``,
            ``quant_format``, feedback as for gradients), averaged, and a
            Nesterov step of ``outer_lr`` / ``outer_momentum`` moves the round's
            starting shard; every replica ends it bit-identical.  Needs
            ``register(..., optimizer=)``.  Memory: two fp32 copies of the
            shard (the round's start, the momentum) on top of the feedback.
        outer_lr: the outer step's learning rate (DiLoCo's 0.7), > 0.
        outer_momentum: the outer step's Nesterov momentum (DiLoCo's 0.9), in
            [0, 1).
        outer_fragments: local steps streamed (Streaming DiLoCo, arXiv 2501.18512):
            the units split into P contiguous fragments of about equal size, each
            synced every ``outer_every`` steps, fragment p at inner steps
            ``p * H // P + k H`` (k >= 1), so 1/P of the model crosses at a time.
            1 (default): every unit at once.  Needs ``outer_every >= P``.
        outer_overlap: tau, inner steps a fragment's sync overlaps: its all-reduce
            starts at step t on a worker thread and its outer step is applied at
            step t + tau (0, default: at once).  Needs tau < H // P (one sync in
            flight at a time).
        outer_mix: alpha, the merge of a fragment at its outer step: its shard
            becomes ``(1 - alpha) * global + alpha * local``, ``global`` the outer
            step's result and ``local`` the replica's own shard then (0, default:
            the global one, every replica identical; > 0 keeps part of the tau
            steps taken meanwhile, and the replicas differ by design).  In [0, 1).
    """

    mode: str = "quant"
    theta: Optional[float] = None
    ratio: Optional[float] = None
    index_bits: int = 1
    value_dtype: Any = torch.float32
    layers: LayerPolicy = "all"
    min_numel: int = 2 ** 16
    error_feedback: bool = True
    seed: int = 0
    residual_dtype: Any = torch.float32
    residual_code: Optional[str] = None
    sketch_factor: float = 1.3
    dense_steps: int = 0
    warmup_steps: int = 0
    warmup_theta: float = 0.75
    quant_format: str = "int4"
    quant_block: int = 256
    ef21: Optional[bool] = None
    ef21_damping: Optional[bool] = None
    bypass_every: int = 0
    gather: str = "none"
    gather_block: int = 256
    fsdp_overlap: bool = True
    guard_ratio: Optional[float] = None
    hsdp_allreduce: str = "auto"
    hsdp_out_format: str = "auto"
    hsdp_overlap: bool = True
    outer_every: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_fragments: int = 1
    outer_overlap: int = 0
    outer_mix: float = 0.0

    def __post_init__(self) -> None:
        # which derived knobs the caller gave: to_dict() writes the others as None
        object.__setattr__(self, "_given", frozenset(
            n for n in DERIVED if getattr(self, n) is not None))
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {self.mode!r}")
        for name in ("theta", "ratio", "sketch_factor"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{name}: must be a number, got {v!r}")
        self._resolve_sparsity()
        if isinstance(self.index_bits, bool) or self.index_bits not in (1, 2, 4, 8):
            raise ValueError(f"index_bits: must be 1, 2, 4 or 8, got {self.index_bits!r}")
        self.value_dtype = _parse_dtype(self.value_dtype, "value_dtype")
        self.residual_dtype = _parse_dtype(self.residual_dtype, "residual_dtype")
        if not callable(self.layers) and self.layers not in ("non_attention", "all"):
            raise ValueError(f"layers: must be 'non_attention', 'all' or a callable, "
                             f"got {self.layers!r}")
        _check_int("min_numel", self.min_numel, 0)
        _check_bool("error_feedback", self.error_feedback)
        _check_int("seed", self.seed, 0, 2 ** 64 - 1)
        if not math.isfinite(self.sketch_factor) or self.sketch_factor <= 0:
            raise ValueError(f"sketch_factor: must be a finite number > 0, "
                             f"got {self.sketch_factor!r}")
        self.sketch_factor = float(self.sketch_factor)
        self._check_warmup()
        if self.quant_format not in QUANT_FORMATS:
            raise ValueError(f"quant_format: must be one of {QUANT_FORMATS}, "
                             f"got {self.quant_format!r}")
        _check_int("quant_block", self.quant_block, 1, 65536)
        if self.ef21 is None:
            # opt-in since issue 42: its state is an unsharded fp32 copy per rank
            self.ef21 = False
        _check_bool("ef21", self.ef21)
        self._resolve_residual_code()
        if self.ef21 and (self.mode == "dense" or not self.error_feedback
                          or self.residual_dtype != torch.float32
                          or self.residual_code != "none"):
            raise ValueError("ef21: needs a compressing mode, error_feedback=True, "
                             "residual_dtype float32 and residual_code 'none' (the ranks' "
                             "estimates must add up to the owner's exactly)")
        if self.ef21_damping is None:
            self.ef21_damping = self.ef21
        _check_bool("ef21_damping", self.ef21_damping)
        if self.ef21_damping and not self.ef21:
            raise ValueError("ef21_damping: damps EF21's estimate; it needs ef21=True")
        _check_int("bypass_every", self.bypass_every, 0)
        if self.bypass_every == 1:
            raise ValueError("bypass_every: 0 (off) or >= 2 (a probe every P reductions), got 1")
        if self.bypass_every and self.mode == "dense":
            raise ValueError("bypass_every: needs a compressing mode (mode='dense' compresses "
                             "nothing to bypass)")
        if self.gather not in GATHER_FORMATS:
            raise ValueError(f"gather: must be one of {GATHER_FORMATS}, got {self.gather!r}")
        _check_int("gather_block", self.gather_block, 1, 65536)
        if self.hsdp_allreduce not in HSDP_ALLREDUCE_FORMS:
            raise ValueError(f"hsdp_allreduce: must be one of {HSDP_ALLREDUCE_FORMS}, got "
                             f"{self.hsdp_allreduce!r}")
        _check_bool("hsdp_overlap", self.hsdp_overlap)
        _check_bool("fsdp_overlap", self.fsdp_overlap)
        _check_int("outer_every", self.outer_every, 0)
        _check_int("outer_fragments", self.outer_fragments, 1)
        _check_int("outer_overlap", self.outer_overlap, 0)
        for name, ok in (("outer_lr", lambda v: v > 0),
                         ("outer_momentum", lambda v: 0 <= v < 1),
                         ("outer_mix", lambda v: 0 <= v < 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not math.isfinite(v) or not ok(v):
                raise ValueError(f"{name}: out of range, got {v!r}")
        if self.outer_every and self.outer_fragments > self.outer_every:
            raise ValueError(f"outer_fragments: at most outer_every ({self.outer_every}) "
                             f"fragments, got {self.outer_fragments}")
        if self.outer_overlap and (not self.outer_every or
                                   self.outer_overlap >= self.outer_every // self.outer_fragments):
            raise ValueError(f"outer_overlap: needs outer_every and tau < outer_every // "
                             f"outer_fragments (one sync in flight), got {self.outer_overlap}")
        if (self.outer_fragments > 1 or self.outer_mix) and not self.outer_every:
            raise ValueError("outer_fragments / outer_mix: need outer_every >= 1 (local steps)")
        if self.hsdp_out_format != "auto" and self.hsdp_out_format not in QUANT_FORMATS:
            raise ValueError(f"hsdp_out_format: must be 'auto' or one of {QUANT_FORMATS}, "
                             f"got {self.hsdp_out_format!r}")
        self._check_guard()
        check_block_codes(coded_pairs(self))

    def _resolve_residual_code(self) -> None:
        c = self.residual_code
        if c is None:
            # quant mode's residual on int4 codes (issue 42: the presets' state within
            # one byte per parameter, quality level on the suite); the top-k modes keep
            # the fp32 residual of the paper's algorithm (their presets state int8
            # codes: int4 cost them 7-16 points, SUITE.md), EF21 needs it exact
            c = "int4" if self.mode == "quant" and self.error_feedback is True and \
                not self.ef21 and self.residual_dtype == torch.float32 else "none"
        if c not in RESIDUAL_CODES:
            raise ValueError(f"residual_code: must be None (derived) or one of "
                             f"{RESIDUAL_CODES}, got {c!r}")
        if c != "none" and self.residual_dtype != torch.float32:
            raise ValueError("residual_code: the residual's working copy is float32; leave "
                             "residual_dtype at float32 (or residual_code 'none')")
        self.residual_code = c

    def _check_guard(self) -> None:
        g = self.guard_ratio
        if g is None:
            return
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) \
                or g < 0:
            raise ValueError(f"guard_ratio: must be None (default), 0 (off) or a finite "
                             f"number > 0, got {g!r}")
        self.guard_ratio = float(g)
        if self.guard_ratio > 0 and (self.mode == "dense" or not self.error_feedback):
            raise ValueError("guard_ratio: the guard watches the error-feedback state; it "
                             "needs error_feedback=True and a compressing mode (set 0 or None)")

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
        resolved): ``"auto"`` is ``int4`` after ``sign``/``ternary``, else
        ``quant_format``."""
        if self.hsdp_out_format != "auto":
            return self.hsdp_out_format
        return "int4" if self.quant_format in ("sign", "ternary") else self.quant_format

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

    def _resolve_sparsity(self) -> None:
        """theta and ratio: paper mode derives one from the other (its presets),
        quant sends everything (theta 0), the other modes default to 0.9875."""
        if self.mode == "paper":
            if self.ratio is None:
                if self.theta is None:
                    self.ratio = 10.0
                else:
                    inv = {th: r for r, th in PAPER_THETA.items()}
                    if float(self.theta) not in inv:
                        raise ValueError(
                            f"ratio: required in paper mode when theta={self.theta} is not "
                            f"one of the paper's presets {sorted(inv)}")
                    self.ratio = inv[float(self.theta)]
            if not math.isfinite(self.ratio) or self.ratio < 1.0:
                raise ValueError(f"ratio: must be a finite number >= 1, got {self.ratio!r}")
            self.ratio = float(self.ratio)
            if self.theta is None:
                if self.ratio not in PAPER_THETA:
                    raise ValueError(
                        f"theta: no paper default for ratio={self.ratio}; give theta "
                        f"(paper presets: {PAPER_THETA})")
                self.theta = PAPER_THETA[self.ratio]
        else:
            if self.ratio is not None:
                raise ValueError(f"ratio: only used by mode='paper' (mode={self.mode!r}); "
                                 "set theta instead")
            if self.mode == "quant":
                if self.theta not in (None, 0, 0.0):
                    raise ValueError(f"theta: mode='quant' sends every entry (theta 0); "
                                     f"got {self.theta!r}")
                self.theta = 0.0
            if self.theta is None:
                self.theta = 0.9875
        self.theta = float(self.theta)
        if not (0.0 <= self.theta < 1.0):
            raise ValueError(f"theta: must be in [0, 1), got {self.theta!r}")

    def _check_warmup(self) -> None:
        for name in ("dense_steps", "warmup_steps"):
            _check_int(name, getattr(self, name), 0)
        if self.warmup_steps and self.mode == "quant":
            raise ValueError("warmup_steps: mode='quant' has no sparsity to ramp; use "
                             "dense_steps")
        w = self.warmup_theta
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0.0 <= w < 1.0):
            raise ValueError(f"warmup_theta: must be a number in [0, 1), got {w!r}")
        if self.warmup_steps and w > self.theta:
            raise ValueError(f"warmup_theta: the warm-up must start at most as sparse as "
                             f"theta={self.theta}, got {w!r}")
        self.warmup_theta = float(w)
        if self.warmup_steps and self.mode == "paper":
            raise ValueError("warmup_steps: not available in mode='paper' (its sketch has a "
                             "fixed S/ratio buckets sized for theta); use dense_steps, or "
                             "mode 'exact'/'sparse'/'auto'")

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
