#!/usr/bin/env python3
"""Cost model of plain FSDP/HSDP and TAGC: bytes per rank and step time per step.

For a model (a parameter count and the fraction TAGC compresses, or a GPT-2 shape),
``N`` ranks per node, ``R`` nodes, the link bandwidths and latencies inside and
between nodes and the codec throughput, it predicts what each rank sends per
optimizer step and how long the step takes, for:

* ``fsdp``: plain FULL_SHARD over all ``N*R`` ranks (a ring all-gather of the
  parameters in forward, again in backward, a ring reduce-scatter of the gradient);
* ``hsdp``: native HSDP (FULL_SHARD inside a node, then a ring all-reduce of each
  rank's shard over the ``R`` replicas);
* ``fsdp+<preset>``: TAGC on FULL_SHARD: the compressed units' reduce-scatter becomes
  an all-to-all of compressed shards (``tagc/transports.py``), with ``full`` also
  the parameter all-gathers on int8 codes (``tagc/gather.py``);
* ``hsdp+<preset>``: TAGC's HSDP route (``tagc/hsdp.py``) with the hook's default
  ``hsdp_allreduce="auto"`` (``allreduce_form``): the all-gather form at ``R = 2`` and
  for ``dense``, the two-phase form where it sends fewer bytes (from ``R = 3``; ``lean``,
  whose owners code on int4, from ``R = 4``);
* ``hsdp+<preset>/2phase``: the two-phase form forced (``hsdp_allreduce="two_phase"``,
  ``TwoPhaseReducer``): each replica's shard in ``R`` chunks, ``R-1`` of them compressed
  to their owners, then every owner's re-compressed chunk of the sum (on the owner's
  code, ``hsdp_out_format``; a name ending ``@FMT`` sets it) all-gathered: about
  ``(R-1)/R`` of the two codes of one shard per rank, flat in ``R``;
* ``hsdp+<preset>/gather``: the all-gather form forced (``hsdp_allreduce="gather"``,
  ``GatherReducer``): every rank all-gathers its compressed shard to the ``R-1`` other
  replicas, ``R-1`` compressed shards per rank.

Which units are compressed follows the selection policy: ``--layers all`` (the
default: what tagc-balanced, tagc-lean and tagc-full use, every parameter of at least
``min_numel`` elements) or ``non_attention`` (the attention QKV inputs uncompressed, as
the presets were until that change and as the measured runs of ``--check`` ran).

Byte counts follow the codec's own size rules (``csrc/tagc_portable.h``
``tagc_q_bytes``, ``csrc/tagc_checks.h`` ``tagc_check_pairs_bytes``) and count what
the hook's ``stats()`` and ``scripts/bench_step.py`` count; ``--check`` compares them
and the step time with the measured runs transcribed in ``docs/cost_model_runs.json``.
Pure standard library (matplotlib only for ``--plot``).  See ``docs/COST_MODEL.md``.

Usage:
    python3 scripts/cost_model.py --params 124e6 --nodes 1,2,4,8 --ranks-per-node 8 \\
        --inter-gbit 25 --intra-gbit 400 --tflops 312 --mfu 0.4
    python3 scripts/cost_model.py --check docs/cost_model_runs.json
    python3 scripts/cost_model.py --plot docs/cost-model.png
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

# --------------------------------------------------------------------------- constants
# Every number below says where it comes from.

# Bytes of one element of the parameter / gradient dtypes FSDP moves.
DTYPE_BYTES = {"fp32": 4, "bf16": 2}

# Quant wire format: one record per block = a 4-byte fp32 scale, then the codes packed
# `per byte` values to a byte (csrc/tagc_portable.h tagc_q_record_bytes, tagc_q_per_byte;
# csrc/tagc.h "Block quantization": sign 8 per byte, ternary 5 per byte in base 3,
# int4 two nibbles, int8 one byte).
QUANT_SCALE_BYTES = 4
QUANT_CODES_PER_BYTE = {"sign": 8, "ternary": 5, "int4": 2, "int8": 1}
# The weight-gather codes (tagc_wq_*) exist for int8 and int4 only (tagc_check_wq_format_ok).
GATHER_FORMATS = ("int8", "int4")

# `sparse` pairs: an int32 offset and a value each (csrc/tagc.h tagc_sparse_bytes:
# k * (4 + size of the value dtype)).
SPARSE_INDEX_BYTES = 4

# The per-call vote (tagc/reducer.py `_agree`): a 4-byte non-finite flag all-reduced;
# with EF21 (damping on by default with ef21) or the guard it widens to four float64
# in the same all-reduce (32 bytes).  `dense` mode sends no vote (scripts/measure_bytes.py
# `simulate`: control = 0 for dense).
VOTE_BYTES_PLAIN = 4
VOTE_BYTES_EF21 = 4 * 8

# TCP/IPv4 over Ethernet with the MTU of 1500 the emulated veth uses: a full segment
# carries 1448 payload bytes (1500 - 20 IP - 20 TCP - 12 timestamp option) in a
# 1514-byte frame (14 Ethernet header).  Only used to turn payload bytes into the
# veth's own counters in --check; the step-time model works on payload bytes and the
# measured payload rate (netem.sh `measure`, a TCP transfer).
TCP_FRAME_OVERHEAD = 1514 / 1448

# TAGC's default selection (configs/tagc-*.yaml, TAGCConfig.min_numel): parameters with
# at least 2^16 elements are candidates.
DEFAULT_MIN_NUMEL = 2 ** 16

# The selection policies (tagc/selection.py select_parameter) the layouts below follow:
# `non_attention` leaves the attention QKV input projections uncompressed, `all` takes
# every parameter of at least min_numel elements.
LAYER_POLICIES = ("non_attention", "all")

# The policy the recommended presets use (configs/tagc-balanced.yaml, tagc-lean.yaml,
# tagc-full.yaml: `layers: all` since the presets-all change).  The measured runs in
# docs/cost_model_runs.json predate it and name their own layout (RUN_MODELS).
DEFAULT_LAYERS = "all"

# FSDP units for a model given only by its size: GPT-2 124M under TAGC's wrapping
# (tagc/selection.py `modules_to_wrap`: per block c_attn, attn.c_proj, mlp.c_fc,
# mlp.c_proj; wpe is a big Embedding and gets its own unit; the root holds the tied
# wte): 12 x 4 + 2.  Only the latency terms and the votes depend on it.
DEFAULT_UNITS = 12 * 4 + 2

# Codec throughput, values per second on one CPU core (this project's 2-core machine),
# from /work/main/docs/RESULTS.md "Codec speed", the S = 2^24 rows (median ms for 2^24
# values): quant encode int4 15.789 ms and ternary 16.612 ms (the AVX2 table, commit
# c8a8754); quant decode int4 5.115 ms and ternary 14.828 ms, select+sparsify 15.653 ms,
# sparse unpack 2.152 ms, auto pack 0.708 ms and auto decode 4.867 ms at theta 0.9875
# (the first table, commit 31aa238); wq encode+decode int8 fp32 17.062 ms, split in two
# halves (encode and decode alone ran at about the same fraction of memcpy: 1.05-1.42
# and 0.93-1.09).  int8 and sign quant were not timed: they take int4's figures.
_MEASURED_MS_PER_2_24 = {
    "quant_encode_int4": 15.789, "quant_encode_ternary": 16.612,
    "quant_decode_int4": 5.115, "quant_decode_ternary": 14.828,
    "sparsify": 15.653, "sparse_unpack": 2.152, "auto_pack": 0.708, "auto_decode": 4.867,
    "wq_encode": 17.062 / 2, "wq_decode": 17.062 / 2,
}
DEFAULT_CODEC = {op: 2 ** 24 / (ms * 1e-3) for op, ms in _MEASURED_MS_PER_2_24.items()}
for _side in ("encode", "decode"):
    for _fmt in ("int8", "sign"):  # not timed: int4's figures
        DEFAULT_CODEC[f"quant_{_side}_{_fmt}"] = DEFAULT_CODEC[f"quant_{_side}_int4"]


# --------------------------------------------------------------------------- size rules


def quant_bytes(n: int, fmt: str, block: int) -> int:
    """Bytes of ``n`` values on quant codes (``tagc_quant_bytes``; a wq segment too).

    Args:
        n: values.
        fmt: ``sign``, ``ternary``, ``int4`` or ``int8``.
        block: values per fp32 scale.
    Returns:
        the exact message size.
    """
    if fmt not in QUANT_CODES_PER_BYTE:
        raise ValueError(f"unknown quant format {fmt!r}; known: {sorted(QUANT_CODES_PER_BYTE)}")
    if n < 0 or block < 1:
        raise ValueError(f"quant_bytes: n must be >= 0 and block >= 1, got {n}, {block}")
    per = QUANT_CODES_PER_BYTE[fmt]
    full, tail = divmod(n, block)
    rec = QUANT_SCALE_BYTES + -(-block // per)
    return full * rec + (QUANT_SCALE_BYTES + -(-tail // per) if tail else 0)


def keep_count(theta: float, s: int) -> int:
    """Entries a rank keeps of a shard of ``s`` (``tagc/config.py`` ``keep_count``).

    Args:
        theta: sparsity in [0, 1).
        s: shard length.
    Returns:
        ``ceil((1 - theta) s)``, at least 1 and at most ``s``.
    """
    if s == 0:
        return 0
    return min(max(math.ceil(round((1.0 - theta) * s, 9)), 1), s)


def ef_low_bits(n: int, k: int) -> int:
    """Elias-Fano low bits for k positions in n (``tagc_check_ef_low_bits``).

    Args:
        n: shard length.
        k: kept positions.
    Returns:
        the largest l with ``k * 2^l <= n`` (0 when k is 0).
    """
    low = 0
    while k > 0 and (k << (low + 1)) <= n:
        low += 1
    return low


def pairs_bytes(n: int, k: int, value_bytes: int) -> int:
    """Bytes of ``auto``'s cheapest coding of k pairs of a shard of n
    (``tagc_check_pairs_bytes`` / ``tagc_check_pairs_cheapest``).

    Args:
        n: shard length.
        k: kept entries.
        value_bytes: bytes per value (4 or 2).
    Returns:
        min over Elias-Fano, bitmap and dense of the message size.
    """
    if k == 0:
        return 0
    low = ef_low_bits(n, k)
    ef = ((k * low + 7) >> 3) + ((k + ((n - 1) >> low) + 1 + 7) >> 3) + k * value_bytes
    bitmap = ((n + 7) >> 3) + k * value_bytes
    return min(ef, bitmap, n * value_bytes)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Unit:
    """One FSDP unit.

    Args:
        name: for reports.
        params: ``(rows, cols)`` of each parameter in FSDP's order (1-D: ``(n, 1)``).
        compressed: whether TAGC compresses its gradient (the selected parameters
            hold at least half of it, ``tagc/selection.py``).
        root: the root unit (FSDP1 gathers it once per step: it is not freed after
            forward under FULL_SHARD).
    """

    name: str
    params: Tuple[Tuple[int, int], ...]
    compressed: bool
    root: bool = False

    def __post_init__(self) -> None:
        if not self.params:
            raise ValueError(f"unit {self.name!r}: no parameters")
        for rows, cols in self.params:
            if rows < 1 or cols < 1:
                raise ValueError(f"unit {self.name!r}: parameter shape must be positive, "
                                 f"got ({rows}, {cols})")

    @property
    def numel(self) -> int:
        """Elements of one unit."""
        return sum(r * c for r, c in self.params)

    def segments(self, n: int, fsdp: int = 2) -> List[int]:
        """One rank's shard as segments (the wq message's), for ``n`` ranks.

        FSDP2 pads each parameter's dim 0 to ``ceil(rows / n)`` rows
        (``padded_sharded_param_size``, DESIGN section 12); FSDP1 pads the flat
        parameter to a multiple of ``n`` (one segment).

        Args:
            n: ranks the unit is sharded over.
            fsdp: 1 or 2.
        Returns:
            the segment lengths, in elements.
        """
        if fsdp == 1:
            return [-(-self.numel // n)]
        return [-(-r // n) * c for r, c in self.params]

    def shard(self, n: int, fsdp: int = 2) -> int:
        """Elements of one rank's shard over ``n`` ranks (padding included).

        Args:
            n: ranks the unit is sharded over.
            fsdp: 1 or 2.
        Returns:
            the shard length.
        """
        return sum(self.segments(n, fsdp))


@dataclass(frozen=True)
class ModelSpec:
    """A model as FSDP units.

    Args:
        name: for reports.
        units: the units (at least one).
    """

    name: str
    units: Tuple[Unit, ...]

    def __post_init__(self) -> None:
        if not self.units:
            raise ValueError(f"model {self.name!r}: no units")

    @property
    def params(self) -> int:
        """Parameters of the model."""
        return sum(u.numel for u in self.units)

    def compressed_fraction(self) -> float:
        """Fraction of the parameters in compressed units."""
        return sum(u.numel for u in self.units if u.compressed) / self.params

    @property
    def unit_count(self) -> int:
        """FSDP units."""
        return len(self.units)


def generic_model(params: float, selected_fraction: Optional[float] = None,
                  units: int = DEFAULT_UNITS, name: Optional[str] = None) -> ModelSpec:
    """A model known by its size: one compressed and one plain aggregate unit.

    Byte counts are then exact up to the per-unit rounding of a real layout (block
    tails, shard padding): below one codec record per unit and rank.

    Args:
        params: parameters (> 0).
        selected_fraction: fraction of them in compressed units, in [0, 1] (default
            :data:`DEFAULT_SELECTED_FRACTION`, the presets' selection).
        units: FSDP units (>= 1): the compressed ones get ``round(fraction * units)``
            of them (at least one when the fraction is above 0).
        name: for reports.
    Returns:
        the model.
    """
    if not params > 0 or not math.isfinite(params):
        raise ValueError(f"params must be a positive number, got {params!r}")
    if selected_fraction is None:
        selected_fraction = DEFAULT_SELECTED_FRACTION
    if not 0.0 <= selected_fraction <= 1.0:
        raise ValueError(f"selected fraction must be in [0, 1], got {selected_fraction!r}")
    total = int(round(params))
    comp = int(round(total * selected_fraction))
    both = 0 < comp < total
    if units < (2 if both else 1):
        raise ValueError(f"units must be >= {2 if both else 1} (compressed and plain "
                         f"parameters need a unit each), got {units}")
    # each side gets its share of the units, at least one
    n_comp = min(units - 1 if both else units, max(1, round(selected_fraction * units))) \
        if comp else 0
    n_plain = units - n_comp
    out = []
    if comp:
        out.append(Unit("compressed", ((comp, 1),), True))
    if total - comp:
        out.append(Unit("plain", ((total - comp, 1),), False))
    # The aggregates stand for n_comp / n_plain FSDP units: those counts scale the
    # latency terms and the per-unit votes, not the bytes.
    counts = tuple(n_comp if u.compressed else n_plain for u in out)
    return CountedModel(name or f"{params:.3g} params", tuple(out), counts)


@dataclass(frozen=True)
class CountedModel(ModelSpec):
    """A :class:`ModelSpec` whose aggregate units stand for more FSDP units.

    Args:
        unit_counts: FSDP units each entry of ``units`` stands for (latency, votes).
    """

    unit_counts: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.unit_counts) != len(self.units) or any(c < 1 for c in self.unit_counts):
            raise ValueError("unit_counts: one count >= 1 per unit")

    @property
    def unit_count(self) -> int:
        """FSDP units the aggregates stand for."""
        return sum(self.unit_counts)


def gpt2_model(n_layer: int, n_embd: int, vocab_size: int, block_size: int,
               layers: str = DEFAULT_LAYERS, min_numel: int = DEFAULT_MIN_NUMEL,
               name: Optional[str] = None) -> ModelSpec:
    """A GPT-2 (``tagc/train/model.py``: biases, tied head) as TAGC wraps it.

    Follows ``tagc/selection.py``: a module gets its own unit if it owns a selected
    parameter or is a linear/embedding layer of at least ``min_numel`` parameters
    (or an attention QKV projection); the tied wte stays in the root with everything
    else (position embedding if small, LayerNorms).  A unit is compressed when its
    selected parameters are at least half of it.

    Args:
        n_layer, n_embd, vocab_size, block_size: the shape.
        layers: ``all`` (default, the presets') or ``non_attention``.
        min_numel: smallest parameter compressed.
        name: for reports.
    Returns:
        the model.
    """
    for k, v in (("n_layer", n_layer), ("n_embd", n_embd), ("vocab_size", vocab_size),
                 ("block_size", block_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive int, got {v!r}")
    _check_layers(layers)
    e = n_embd

    def sel(numel: int, weight: bool, qkv: bool) -> bool:
        """Whether the policy selects a parameter."""
        # tagc/selection.py select_parameter: size first, then (non_attention) a
        # linear/embedding weight that is not a QKV projection
        if numel < min_numel:
            return False
        return True if layers == "all" else (weight and not qkv)

    def linear(nm: str, out_f: int, in_f: int, qkv: bool = False) -> Optional[Unit]:
        """A Linear (weight + bias) as its own unit, or None when it stays in the root."""
        w = out_f * in_f
        own = sel(w, True, qkv) or w + out_f >= max(min_numel, 1) or qkv
        if not own:
            return None
        selected = w if sel(w, True, qkv) else 0
        return Unit(nm, ((out_f, in_f), (out_f, 1)), selected * 2 >= w + out_f)

    units: List[Unit] = []
    root: List[Tuple[int, int]] = [(vocab_size, e)]  # wte, tied with lm_head
    root_sel = vocab_size * e if sel(vocab_size * e, True, False) else 0
    wpe = block_size * e
    if sel(wpe, True, False) or wpe >= max(min_numel, 1):
        units.append(Unit("wpe", ((block_size, e),), sel(wpe, True, False)))
    else:
        root.append((block_size, e))
    for i in range(n_layer):
        root += [(e, 1)] * 4  # ln_1, ln_2: weight and bias (too small to be selected)
        for u in (linear(f"h{i}.attn.c_attn", 3 * e, e, qkv=True),
                  linear(f"h{i}.attn.c_proj", e, e),
                  linear(f"h{i}.mlp.c_fc", 4 * e, e),
                  linear(f"h{i}.mlp.c_proj", e, 4 * e)):
            if u is not None:
                units.append(u)
    root += [(e, 1)] * 2  # ln_f
    root_n = sum(r * c for r, c in root)
    units.insert(0, Unit("root", tuple(root), root_sel * 2 >= root_n, root=True))
    label = name or f"GPT-2 {n_layer}x{n_embd} vocab {vocab_size}"
    return ModelSpec(label, tuple(units))


def _check_layers(layers: str) -> None:
    """Refuse a selection policy the layouts do not model.

    Args:
        layers: ``non_attention`` or ``all``.
    Raises:
        ValueError: any other value (a callable policy has no layout here).
    """
    if layers not in LAYER_POLICIES:
        raise ValueError(f"layers must be one of {LAYER_POLICIES}, got {layers!r}")


# The GPT-2 shapes of this repository: (n_layer, n_embd, vocab_size, block_size, label).
GPT2_SHAPES: Dict[str, Tuple[int, int, int, int, str]] = {
    # the step benchmark's model (scripts/bench_step.py ModelShape defaults)
    "bench": (2, 512, 16384, 64, "bench GPT-2 (2x512, vocab 16384)"),
    # the quality runs' (configs/train-tiny.yaml: model tiny = 2 layers, width 256,
    # block 128; byte tokenizer of 257 ids padded to a multiple of 64)
    "tiny": (2, 256, 320, 128, "tiny GPT-2"),
    # GPT-2 small (tagc/train/model.py GPTConfig defaults)
    "gpt2-124m": (12, 768, 50304, 1024, "GPT-2 124M"),
}


def named_gpt2(shape: str, layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """One of :data:`GPT2_SHAPES` as TAGC wraps it under a selection policy.

    Args:
        shape: a key of :data:`GPT2_SHAPES`.
        layers: the selection policy (default the presets').
    Returns:
        the layout, named with its policy (reports and plots tell them apart).
    """
    n_layer, n_embd, vocab_size, block_size, label = GPT2_SHAPES[shape]
    return gpt2_model(n_layer, n_embd, vocab_size, block_size, layers=layers,
                      name=f"{label}, layers={layers}")


def bench_gpt2(layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """The step benchmark's model: ``named_gpt2("bench", layers)``."""
    return named_gpt2("bench", layers)


def tiny_gpt2(layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """The quality runs' tiny GPT-2: ``named_gpt2("tiny", layers)``."""
    return named_gpt2("tiny", layers)


def gpt2_124m(layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """GPT-2 small: ``named_gpt2("gpt2-124m", layers)``."""
    return named_gpt2("gpt2-124m", layers)


def linear_pair_model(width: int = 512, layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """``scripts/measure_bytes.py``'s model: Linear(w, 4w) and Linear(4w, w), no bias,
    ``layers: all``, ``min_numel`` 4096: two compressed units and an empty root.

    Args:
        width: w.
        layers: accepted for a uniform :data:`MODELS` call; both policies select both
            weights (linear weights, no attention input projection), so the layout is
            the same.
    Returns:
        the layout.
    """
    _check_layers(layers)
    return ModelSpec(f"Linear {width}x{4 * width} pair",
                     (Unit("fc1", ((4 * width, width),), True),
                      Unit("fc2", ((width, 4 * width),), True)))


# The layouts ``--model`` offers, each built for a selection policy (``--layers``).
MODELS: Dict[str, Callable[..., ModelSpec]] = {
    "bench": bench_gpt2, "tiny": tiny_gpt2, "gpt2-124m": gpt2_124m,
    "linear-pair": linear_pair_model}

# The layouts the measured runs used, by the name docs/cost_model_runs.json gives them:
# (layout, policy).  Every run there predates the presets' move to `layers: all`, so a
# bare name is the policy they had then (non_attention); "bench-all" is bench_step.py's
# `--override layers=all`.  Fixed here, not taken from --layers, so that --check
# compares each run with the layout it ran.
RUN_MODELS: Dict[str, Tuple[str, str]] = {
    "bench": ("bench", "non_attention"), "bench-all": ("bench", "all"),
    "tiny": ("tiny", "non_attention"), "linear-pair": ("linear-pair", "all")}


def run_model(name: str) -> ModelSpec:
    """The layout a runs-file model name stands for.

    Args:
        name: a key of :data:`RUN_MODELS`.
    Returns:
        the layout, under the policy that run used.
    """
    layout, layers = RUN_MODELS[name]
    return MODELS[layout](layers=layers)


def default_selected_fraction(layers: str = DEFAULT_LAYERS) -> float:
    """Fraction of the parameters in compressed units for a model given only by its size.

    Taken from the tiny GPT-2 of the quality runs under ``layers`` (recomputed from its
    layout, so it follows the selection rules above): under ``non_attention``
    everything but the two attention QKV units (2 x 197,376 of 1,694,720 parameters),
    0.767; under ``all`` every unit (the root holds the tied wte, which is more than
    half of it), 1.0.

    Args:
        layers: the selection policy.
    Returns:
        the fraction, in [0, 1].
    """
    return tiny_gpt2(layers).compressed_fraction()


# --params' default: the presets' selection on the tiny GPT-2.
DEFAULT_SELECTED_FRACTION = default_selected_fraction(DEFAULT_LAYERS)


def unit_counts(model: ModelSpec) -> List[int]:
    """FSDP units each entry of ``model.units`` stands for."""
    if isinstance(model, CountedModel):
        return list(model.unit_counts)
    return [1] * len(model.units)


# --------------------------------------------------------------------------- cluster

# Collectives the measured tables distinguish (scripts/bench_collectives.py OPS): gloo's
# all-gather and all-to-all do not reach its all-reduce's rate, and TAGC's exchange
# (tagc/comm.py isend/irecv to every peer: p2p, all posted at once; p2p_ring, in ring
# steps, what the CPU path does from three ranks) is neither.
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "all_to_all", "p2p", "p2p_ring")
# The process groups a table is measured on (bench_collectives.py): every rank, a
# node's ranks (the intra-node link), one rank per node (HSDP's replicas).
COLLECTIVE_GROUPS = ("world", "node", "replica")


@dataclass(frozen=True)
class CollectiveRates:
    """Measured rates of collectives: bytes per second a host's link carries, per
    process group, collective and size (``scripts/bench_collectives.py``, the
    nccl-tests of the emulated network).

    Between the measured sizes the rate is interpolated linearly in log(size); outside
    them the nearest size's rate holds.  A (group, kind) the table lacks falls back to
    the cluster's link bandwidth.

    Args:
        tables: {group: {kind: ((size bytes, bytes/s), ...)}}, sizes increasing; size
            = the full tensor (all-reduce input, all-gather output, all-to-all and p2p
            input), rate = the bytes :func:`link_bytes` counts on the link (times the
            node's N ranks for ``replica``) over the slowest rank's time.
        source: where the table comes from (printed with predictions).
    """

    tables: Dict[str, Dict[str, Tuple[Tuple[float, float], ...]]]
    source: str = ""

    def __post_init__(self) -> None:
        for g, kinds in self.tables.items():
            if g not in COLLECTIVE_GROUPS:
                raise ValueError(f"collective group {g!r}: one of {list(COLLECTIVE_GROUPS)}")
            for k, rows in kinds.items():
                if k not in COLLECTIVE_KINDS:
                    raise ValueError(f"collective {k!r}: one of {list(COLLECTIVE_KINDS)}")
                if not rows or any(len(r) != 2 or not (r[0] > 0 and r[1] > 0) for r in rows) \
                        or any(a[0] >= b[0] for a, b in zip(rows, rows[1:])):
                    raise ValueError(f"{g}/{k}: rows must be (size > 0, rate > 0) pairs with "
                                     "increasing sizes")

    @classmethod
    def from_report(cls, report: Dict[str, Any], source: str = "") -> "CollectiveRates":
        """The table of a ``bench_collectives.py`` output (its ``collectives`` entry).

        Raises:
            ValueError: not such an output.
        """
        tab = report.get("collectives") if isinstance(report, dict) else None
        if not isinstance(tab, dict) or not tab:
            raise ValueError("not a bench_collectives.py output: no 'collectives' table")
        return cls({g: {k: tuple((float(a), float(b)) for a, b in rows)
                        for k, rows in kinds.items()} for g, kinds in tab.items()},
                   source or report.get("command", ""))

    def rate(self, group: str, kind: str, size: float) -> Optional[float]:
        """Bytes per second for one call, or None when the table lacks (group, kind).

        Args:
            group: one of :data:`COLLECTIVE_GROUPS`.
            kind: one of :data:`COLLECTIVE_KINDS`.
            size: bytes of the full tensor.
        """
        rows = self.tables.get(group, {}).get(kind)
        if not rows:
            return None
        if size <= rows[0][0]:
            return rows[0][1]
        for (s0, r0), (s1, r1) in zip(rows, rows[1:]):
            if size <= s1:
                f = math.log(size / s0) / math.log(s1 / s0)
                return r0 + f * (r1 - r0)
        return rows[-1][1]




@dataclass(frozen=True)
class Cluster:
    """The machines and links.

    Args:
        ranks_per_node: ranks (GPUs, or processes) per node, ``N`` (>= 1).
        nodes: nodes ``R`` (>= 1).
        intra_gbit: bandwidth of a rank's link to the other ranks of its node, Gbit/s
            of payload.
        inter_gbit: bandwidth of a node's link to the other nodes (shared by its
            ranks), Gbit/s of payload.
        intra_latency_s: per-message latency inside a node.
        inter_latency_s: per-message latency between nodes.
        backend: ``nccl`` (ring reduce-scatter) or ``gloo`` (its reduce-scatter is an
            all-reduce: twice the bytes, DESIGN section 4).
        overlap: fraction of the compute time that can hide communication, in [0, 1]
            (0: nothing hidden, as plain FSDP with gloo on the CPU, and every run
            ``--check`` compares with; 1: a step takes
            ``max(compute, communication)`` plus the codec).
        link_efficiency: fraction of the bandwidth collectives reach, in (0, 1]
            (1: first principles; ``--check`` can fit it to a measured plain step); it
            scales the measured rates too.
        collectives: measured collective rates (:class:`CollectiveRates`); where they
            cover a collective they replace the link bandwidths.
        pair_gather: TAGC's all-gathers over two gloo ranks go as one isend/irecv
            exchange (``tagc/comm.py`` ``exchanges_pairwise``; timed as ``p2p``); False
            for runs of the code before it (gloo's all-gather).
        ring_exchange: TAGC's exchange over three or more gloo ranks goes in ring
            steps (``tagc/comm.py`` ``Comm.stepped``; timed as ``p2p_ring``, else as
            ``p2p``); False for runs of the code before it (every message at once).
    """

    ranks_per_node: int
    nodes: int
    intra_gbit: float
    inter_gbit: float
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 30e-6
    backend: str = "nccl"
    overlap: float = 0.0
    link_efficiency: float = 1.0
    collectives: Optional[CollectiveRates] = None
    pair_gather: bool = True
    ring_exchange: bool = True

    def __post_init__(self) -> None:
        for k in ("ranks_per_node", "nodes"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be an int >= 1, got {v!r}")
        for k in ("intra_gbit", "inter_gbit"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{k} must be a positive bandwidth in Gbit/s, got {v!r}")
        for k in ("intra_latency_s", "inter_latency_s"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{k} must be a latency >= 0 seconds, got {v!r}")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap!r}")
        if not 0.0 < self.link_efficiency <= 1.0:
            raise ValueError(f"link_efficiency must be in (0, 1], got {self.link_efficiency!r}")

    @property
    def world(self) -> int:
        """All ranks, ``N * R``."""
        return self.ranks_per_node * self.nodes

    def bytes_per_s(self, inter: bool) -> float:
        """Payload bytes per second of a link, efficiency applied.

        Args:
            inter: the inter-node link (else the intra-node one).
        Returns:
            bytes per second.
        """
        gbit = self.inter_gbit if inter else self.intra_gbit
        return gbit * 1e9 / 8 * self.link_efficiency

    def measured_s(self, group: str, kind: str, size: float, link: float) -> Optional[float]:
        """Seconds of one collective from the measured rates, or None when not covered.

        Args:
            group: ``world``, ``node`` or ``replica``.
            kind: one of :data:`COLLECTIVE_KINDS`.
            size: bytes of the full tensor.
            link: bytes one rank puts on the link (:class:`_Step`'s ``link``).
        """
        if self.collectives is None:
            return None
        # one rank per node: the replicas are the world; a table measured before
        # p2p_ring existed times the ring steps as p2p
        groups = [group] + (["world"] if group == "replica" and self.ranks_per_node == 1 else [])
        kinds = [kind] + (["p2p"] if kind == "p2p_ring" else [])
        rate = next((r for k in kinds for g in groups
                     if (r := self.collectives.rate(g, k, size)) is not None), None)
        if rate is None:
            return None
        share = self.ranks_per_node if group == "replica" else 1
        return link * share / (rate * self.link_efficiency)


# --------------------------------------------------------------------------- configurations

GRAD_MODES = ("dense", "sparse", "auto", "quant")


@dataclass(frozen=True)
class Compression:
    """TAGC's gradient exchange for the compressed units (``TAGCConfig`` fields).

    Args:
        mode: ``dense``, ``sparse``, ``auto`` or ``quant`` (``exact`` and ``paper``
            are not modelled: their bytes depend on the data).
        quant_format: ``int4``, ``ternary``, ``int8`` or ``sign``.
        quant_block: values per fp32 scale.
        theta: sparsity of the top-k modes.
        value_bytes: bytes of a kept value (``value_dtype``; 4 = float32).
        ef21: EF21 feedback (its vote is 32 bytes, not 4).
        gather: parameter all-gather codes, ``none``, ``int8`` or ``int4`` (FSDP2 only).
        gather_block: values per fp32 scale of the gather codes.
        out_format: two-phase HSDP's to-everyone code (``hsdp_out_format``); ``auto``:
            ``int4`` after ``sign``/``ternary``, else ``quant_format``.
    """

    mode: str
    quant_format: str = "int4"
    quant_block: int = 256
    theta: float = 0.9875
    value_bytes: int = 4
    ef21: bool = False
    gather: str = "none"
    gather_block: int = 256
    out_format: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in GRAD_MODES:
            raise ValueError(f"unknown mode {self.mode!r}; modelled: {list(GRAD_MODES)} "
                             "(exact and paper send data-dependent bytes)")
        if self.quant_format not in QUANT_CODES_PER_BYTE:
            raise ValueError(f"unknown quant format {self.quant_format!r}; known: "
                             f"{sorted(QUANT_CODES_PER_BYTE)}")
        if self.out_format != "auto" and self.out_format not in QUANT_CODES_PER_BYTE:
            raise ValueError(f"unknown out format {self.out_format!r}; known: auto, "
                             f"{', '.join(sorted(QUANT_CODES_PER_BYTE))}")
        if not 1 <= self.quant_block <= 65536 or not 1 <= self.gather_block <= 65536:
            raise ValueError("quant_block and gather_block must be in 1..65536 "
                             "(TAGC_QBLOCK_MAX)")
        if not 0.0 <= self.theta < 1.0:
            raise ValueError(f"theta must be in [0, 1), got {self.theta!r}")
        if self.value_bytes not in (2, 4):
            raise ValueError(f"value_bytes must be 2 or 4, got {self.value_bytes!r}")
        if self.gather not in ("none",) + GATHER_FORMATS:
            raise ValueError(f"unknown gather format {self.gather!r}; known: none, "
                             f"{', '.join(GATHER_FORMATS)}")

    @property
    def owner_format(self) -> str:
        """The code of an owner's sum (``TAGCConfig.out_format``)."""
        if self.out_format != "auto":
            return self.out_format
        return "int4" if self.quant_format in ("sign", "ternary") else self.quant_format

    @property
    def vote_bytes(self) -> int:
        """Bytes of the per-call vote all-reduce."""
        if self.mode == "dense":
            return 0
        return VOTE_BYTES_EF21 if self.ef21 else VOTE_BYTES_PLAIN


# The presets in configs/ (same names as scripts/bench_step.py's CONFIGS).
PRESETS: Dict[str, Compression] = {
    "dense": Compression("dense"),                                     # tagc-dense.yaml
    "sparse": Compression("sparse", theta=0.9875),                     # tagc-sparse.yaml
    "auto": Compression("auto", theta=0.9875),                         # tagc-auto.yaml
    "balanced": Compression("quant", "int4", ef21=True),               # tagc-balanced.yaml
    "lean": Compression("quant", "ternary"),                           # tagc-lean.yaml
    # tagc-lean until it dropped its feedback: the runs file's lean rows ran it
    "lean-ef21": Compression("quant", "ternary", ef21=True),
    "full": Compression("quant", "int4", ef21=True, gather="int8"),    # tagc-full.yaml
}


# HSDP's all-reduce forms between replicas (tagc/hsdp.py ``hsdp_allreduce``), and the
# name suffix that forces one: ``hsdp+P`` = auto, ``hsdp+P/2phase``, ``hsdp+P/gather``.
HSDP_FORMS = ("auto", "all-gather", "two-phase")
FORM_SUFFIX = {"": "auto", "2phase": "two-phase", "gather": "all-gather"}


@dataclass(frozen=True)
class Config:
    """One way to run a step.

    Args:
        name: for reports.
        layout: ``full_shard`` (FSDP over every rank) or ``hsdp`` (FSDP inside a node,
            replicas across nodes).
        tagc: TAGC's compression, or None for plain FSDP/HSDP.
        cross: HSDP's exchange between replicas with TAGC (``hsdp_allreduce``):
            ``auto`` (the hook's default, :func:`hsdp_form`), ``all-gather`` or
            ``two-phase``.
        dtype: parameter and gradient dtype on the wire, ``fp32`` or ``bf16``
            (FSDP2 MixedPrecisionPolicy param_dtype = reduce_dtype).
        fsdp: 1 or 2 (FSDP1 gathers the root once per step; no gathers hook, no HSDP).
    """

    name: str
    layout: str
    tagc: Optional[Compression] = None
    cross: str = "auto"
    dtype: str = "fp32"
    fsdp: int = 2

    def __post_init__(self) -> None:
        if self.layout not in ("full_shard", "hsdp"):
            raise ValueError(f"layout must be 'full_shard' or 'hsdp', got {self.layout!r}")
        if self.cross not in HSDP_FORMS:
            raise ValueError(f"cross must be one of {list(HSDP_FORMS)}, got {self.cross!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.fsdp not in (1, 2):
            raise ValueError(f"fsdp must be 1 or 2, got {self.fsdp!r}")
        if self.fsdp == 1 and self.layout == "hsdp":
            raise ValueError("FSDP1 refuses comm hooks on HYBRID_SHARD: HSDP needs fsdp=2")
        if self.fsdp == 1 and self.tagc is not None and self.tagc.gather != "none":
            raise ValueError("quantized gathers need FSDP2 (FSDP1 has no all-gather hook)")
        if self.cross != "auto" and (self.layout != "hsdp" or self.tagc is None):
            raise ValueError(f"the {self.cross} form (hsdp_allreduce) is TAGC's HSDP exchange "
                             "between replicas: hsdp+P/2phase or hsdp+P/gather only")


def hsdp_form(cross: str, t: Compression, replicas: int, s: int) -> str:
    """The form one compressed unit's exchange takes (``tagc/hsdp.py`` ``allreduce_form``).

    ``auto``: ``dense`` takes the all-gather form (one plain all-reduce); ``quant``
    the two-phase form where its bytes are fewer ((R-1) chunk codes plus (R-1) of
    the owner's code against (R-1) shard codes; at equal bytes the all-gather form);
    ``sparse``/``auto`` the all-gather form at 2 replicas and the two-phase form
    from 3 on.  (``exact``/``paper``, always two-phase in the hook, are not modelled.)

    Args:
        cross: :attr:`Config.cross`.
        t: the compression.
        replicas: R.
        s: the unit's shard (elements).
    Returns:
        ``all-gather`` or ``two-phase``.
    """
    if cross != "auto":
        return cross
    if t.mode == "dense" or replicas <= 2:
        return "all-gather"
    if t.mode == "quant":
        chunk = -(-s // replicas)
        two = quant_bytes(chunk, t.quant_format, t.quant_block) \
            + quant_bytes(chunk, t.owner_format, t.quant_block)
        return "two-phase" if two < quant_bytes(s, t.quant_format, t.quant_block) \
            else "all-gather"
    return "two-phase"


def make_config(name: str, dtype: str = "fp32", fsdp: int = 2) -> Config:
    """A configuration from its name: ``fsdp``, ``hsdp``, ``fsdp+PRESET``,
    ``hsdp+PRESET`` (the hook's default form, ``auto``), ``hsdp+PRESET/2phase`` or
    ``hsdp+PRESET/gather`` (a form forced) (PRESET one of :data:`PRESETS`); an HSDP
    name may end in ``@FMT``, the owner's code of the two-phase form
    (``hsdp_out_format``; runs measured before its default became ``int4`` after
    ternary are ``hsdp+lean-ef21/2phase@ternary``).

    Args:
        name: the name.
        dtype: ``fp32`` or ``bf16``.
        fsdp: 1 or 2.
    Returns:
        the configuration.
    """
    head, _, out = name.partition("@")
    base, _, topo = head.partition("/")
    layout_s, _, preset = base.partition("+")
    layouts = {"fsdp": "full_shard", "hsdp": "hsdp"}
    if layout_s not in layouts or (preset and preset not in PRESETS) \
            or topo not in FORM_SUFFIX or (topo and not preset) \
            or ("@" in name and (layout_s != "hsdp" or not preset or not out)):
        raise ValueError(f"unknown configuration {name!r}: use fsdp, hsdp, fsdp+P, hsdp+P, "
                         f"hsdp+P/2phase or hsdp+P/gather with P one of {sorted(PRESETS)}, "
                         "an HSDP one optionally ending in @FMT (the owner's code)")
    comp = PRESETS[preset] if preset else None
    if comp is not None and out:
        comp = replace(comp, out_format=out)
    return Config(name, layouts[layout_s], comp, FORM_SUFFIX[topo], dtype, fsdp)


DEFAULT_CONFIGS = ("fsdp", "hsdp", "fsdp+balanced", "fsdp+lean", "fsdp+full",
                   "hsdp+balanced", "hsdp+lean", "hsdp+balanced/gather", "hsdp+lean/gather")


# --------------------------------------------------------------------------- prediction


@dataclass
class Prediction:
    """What one configuration costs per optimizer step.

    Attributes:
        config: the configuration.
        ideal: bytes one rank sends per category as the hook and the benchmark count
            them (ring collectives' ideal bytes: reduce-scatter ``(G-1)/G``; keys
            ``gather``, ``grad`` (FSDP's reduce-scatter or TAGC's exchange inside the
            reduce-scatter group), ``cross`` (HSDP between replicas), ``control``).
        link: the same as the backend sends it (gloo's reduce-scatter is an all-reduce).
        node_inter: bytes one node puts on its inter-node link.
        comm_s: time in collectives (none overlapped with each other).
        codec_s: time in the codec.
        compute_s: compute time given.
        messages: latency terms counted.
    """

    config: Config
    ideal: Dict[str, float] = field(default_factory=dict)
    link: Dict[str, float] = field(default_factory=dict)
    node_inter: float = 0.0
    comm_s: float = 0.0
    codec_s: float = 0.0
    compute_s: float = 0.0
    messages: int = 0
    overlap: float = 0.0

    @property
    def bytes_per_rank(self) -> float:
        """Bytes one rank sends per step on the backend."""
        return sum(self.link.values())

    @property
    def ideal_bytes_per_rank(self) -> float:
        """Ideal-ring bytes one rank sends per step."""
        return sum(self.ideal.values())

    @property
    def step_s(self) -> float:
        """Compute + codec + the communication compute does not hide."""
        hidden = min(self.comm_s, self.overlap * self.compute_s)
        return self.compute_s + self.codec_s + self.comm_s - hidden


class _Step:
    """Accumulates one step's collectives into a :class:`Prediction`.

    Every call describes one collective of one unit: ``times`` = how many of them run
    per step for the bytes (1 per unit and call), ``lat`` = how many FSDP units it
    stands for (the latency terms and the per-unit votes; > 1 for the aggregate units
    of :func:`generic_model`).
    """

    def __init__(self, cluster: Cluster, pred: Prediction) -> None:
        self.c, self.p = cluster, pred

    def _account(self, cat: str, ideal: float, link: float, crosses: bool, intra: float,
                 nic: float, steps: int, times: int, lat: int,
                 measured: Optional[Tuple[str, str, float]] = None) -> None:
        """Add bytes, and time = the slowest link the collective uses + latencies.

        Args:
            cat: byte category.
            ideal, link: bytes one rank sends (ideal ring / the backend).
            crosses: whether it uses the inter-node link.
            intra: bytes one rank puts on its intra-node link.
            nic: bytes one node puts on its inter-node link.
            steps: sequential message steps (latency terms) of one call.
            times: calls, for the bytes.
            lat: FSDP units, for the latencies.
            measured: (group, kind, size) to look up in the measured collective rates
                (None: not a measured collective); where they cover it, its time.
        """
        c, p = self.c, self.p
        p.ideal[cat] = p.ideal.get(cat, 0.0) + ideal * times
        p.link[cat] = p.link.get(cat, 0.0) + link * times
        t = intra / c.bytes_per_s(False) if intra else 0.0
        if crosses:
            t = max(t, nic / c.bytes_per_s(True))
            p.node_inter += nic * times
        if measured is not None:
            m = c.measured_s(*measured, link)
            t = t if m is None else m
        p.comm_s += t * times + steps * lat * (c.inter_latency_s if crosses
                                                else c.intra_latency_s)
        p.messages += steps * lat

    def _crosses(self, group: str) -> bool:
        """Whether a collective over ``group`` uses the inter-node link."""
        return group == "replica" or (group == "world" and self.c.nodes > 1)

    def ring(self, cat: str, group: str, g: int, kind: str, nbytes: float, times: int,
             lat: int, tagc: bool = False) -> None:
        """A ring collective over ``g`` ranks.

        Args:
            cat: byte category.
            group: ``world`` (all ranks, node by node), ``node`` (the ranks of a node)
                or ``replica`` (one rank per node; the N such groups run at once).
            g: ranks in the group.
            kind: ``all_gather`` (nbytes = one rank's piece), ``reduce_scatter`` or
                ``all_reduce`` (nbytes = the whole input of one rank).
            nbytes: see kind.
            times: calls, for the bytes.
            lat: FSDP units, for the latencies.
            tagc: TAGC's own collective (its all-gathers over two gloo ranks are an
                exchange, :attr:`Cluster.pair_gather`), not FSDP's.
        """
        if g <= 1 or nbytes == 0:
            return
        # measured: the table entry timing it, and the size the tables index by
        if kind == "all_gather":
            ideal = link = (g - 1) * nbytes
            steps = g - 1
            pair = tagc and g == 2 and self.c.backend == "gloo" and self.c.pair_gather
            measured: Optional[Tuple[str, str, float]] = (group, "p2p" if pair else kind,
                                                          g * nbytes)
        elif kind == "reduce_scatter":
            ideal = (g - 1) / g * nbytes
            gloo = self.c.backend == "gloo"  # gloo: an all-reduce underneath
            link = 2 * ideal if gloo else ideal
            steps = 2 * (g - 1) if gloo else g - 1
            measured = (group, "all_reduce", nbytes) if gloo else None
        elif kind == "all_reduce":
            ideal = link = 2 * (g - 1) / g * nbytes
            steps = 2 * (g - 1)
            measured = (group, kind, nbytes)
        else:
            raise ValueError(f"unknown collective {kind!r}")
        crosses = self._crosses(group)
        # A node-contiguous ring crosses each node boundary once, so a node's link
        # carries one rank's bytes; replica groups: the node's N rings all cross it.
        nic = link * (self.c.ranks_per_node if group == "replica" else 1)
        intra = link if group != "replica" and self.c.ranks_per_node > 1 else 0.0
        self._account(cat, ideal, link, crosses, intra, nic, steps, times, lat, measured)

    def all_to_all(self, cat: str, group: str, g: int, msg: float, times: int,
                   lat: int, kind: str = "all_to_all") -> None:
        """Each rank sends ``msg`` bytes to each of the ``g - 1`` others.

        Args:
            cat: byte category.
            group: ``world`` or ``replica`` (as :meth:`ring`).
            g: ranks in the group.
            msg: bytes of one message.
            times: calls, for the bytes.
            lat: FSDP units, for the latencies.
            kind: ``all_to_all`` (one ``all_to_all_single``) or ``p2p`` (an isend to
                and an irecv from every peer, ``tagc/comm.py``): the same bytes, not the
                same rate on gloo.
        """
        if g <= 1 or msg == 0:
            return
        n = self.c.ranks_per_node
        if group == "world":
            # a node's N ranks each send to the g - N ranks of the other nodes
            nic, intra = n * (g - n) * msg, (min(n, g) - 1) * msg
        else:  # replica: every rank's g - 1 messages leave the node
            nic, intra = n * (g - 1) * msg, 0.0
        if kind == "p2p" and g >= 3 and self.c.backend == "gloo" and self.c.ring_exchange:
            kind = "p2p_ring"
        self._account(cat, (g - 1) * msg, (g - 1) * msg, self._crosses(group), intra, nic,
                      g - 1, times, lat, (group, kind, g * msg))


def predict(model: ModelSpec, cluster: Cluster, config: Config, compute_s: float = 0.0,
            codec: Optional[Dict[str, float]] = None) -> Prediction:
    """Bytes and time of one optimizer step.

    Collectives run one after the other (FSDP issues them in order on one stream);
    ``cluster.overlap`` decides how much of their total hides behind compute.

    Args:
        model: the units.
        cluster: ranks, links, backend, overlap.
        config: the configuration.
        compute_s: forward + backward + optimizer time of one step (>= 0).
        codec: values per second of codec ops (keys of :data:`DEFAULT_CODEC`), replacing
            the defaults.
    Returns:
        the prediction.
    """
    if not (isinstance(compute_s, (int, float)) and math.isfinite(compute_s) and compute_s >= 0):
        raise ValueError(f"compute time must be >= 0 seconds, got {compute_s!r}")
    rates = codec_rates(codec or {})
    p = Prediction(config, compute_s=compute_s, overlap=cluster.overlap)
    st = _Step(cluster, p)
    t = config.tagc
    eb = DTYPE_BYTES[config.dtype]
    hsdp = config.layout == "hsdp"
    group, g = ("node", cluster.ranks_per_node) if hsdp else ("world", cluster.world)
    for u, cnt in zip(model.units, unit_counts(model)):
        segs = u.segments(g, config.fsdp)
        s = sum(segs)
        # -- parameter all-gathers: forward and backward (FSDP1's root: forward only)
        calls = 1 if (config.fsdp == 1 and u.root) else 2
        if t is not None and t.gather != "none":
            msg = sum(quant_bytes(x, t.gather, t.gather_block) for x in segs)
            st.ring("gather", group, g, "all_gather", msg, calls, calls * cnt, tagc=True)
            if g > 1:  # tagc/gather.py: encode the own shard, decode all g messages
                p.codec_s += calls * (s / rates["wq_encode"] + g * s / rates["wq_decode"])
        else:
            st.ring("gather", group, g, "all_gather", s * eb, calls, calls * cnt)
        # -- gradient over the reduce-scatter group (every rank, or the node's)
        compressed = t is not None and u.compressed
        if compressed and not hsdp and g > 1:
            _exchange(st, p, t, g, s, eb, cnt, rates)
        else:
            st.ring("grad", group, g, "reduce_scatter", g * s * eb, 1, cnt)
        # -- HSDP: each rank's shard over the R replicas
        if hsdp and cluster.nodes > 1:
            if compressed:
                _cross(st, p, t, config.cross, cluster.nodes, s, eb, cnt, rates)
            else:
                st.ring("cross", "replica", cluster.nodes, "all_reduce", s * eb, 1, cnt)
    return p


def codec_rates(overrides: Dict[str, float], speedup: float = 1.0) -> Dict[str, float]:
    """The codec throughputs: the defaults, times ``speedup``, with ``overrides``.

    Args:
        overrides: values per second per op (keys of :data:`DEFAULT_CODEC`).
        speedup: factor on the defaults (> 0).
    Returns:
        every op's values per second.
    """
    if not (math.isfinite(speedup) and speedup > 0):
        raise ValueError(f"codec speedup must be > 0, got {speedup!r}")
    rates = {k: v * speedup for k, v in DEFAULT_CODEC.items()}
    for k, v in overrides.items():
        if k not in DEFAULT_CODEC:
            raise ValueError(f"unknown codec op {k!r}; known: {sorted(DEFAULT_CODEC)}")
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"codec throughput {k} must be > 0 values/s, got {v!r}")
        rates[k] = float(v)
    return rates


def _pairs_msg(t: Compression, s: int, eb: int) -> int:
    """One message of k pairs (``tagc/transports.py`` ``pairs_wire``): ``sparse``'s
    int32 offsets + values, or ``auto``'s cheapest coding (values in the gradient's
    dtype when it is narrower, ``auto_value_dtype``)."""
    k = keep_count(t.theta, s)
    if t.mode == "sparse":
        return k * (SPARSE_INDEX_BYTES + t.value_bytes)
    return pairs_bytes(s, k, min(t.value_bytes, eb))


def _pairs_codec(t: Compression, s: int, shards: int, messages: int,
                 rates: Dict[str, float]) -> float:
    """Seconds to select ``shards`` shards of s and add ``messages`` messages."""
    if t.mode == "sparse":
        return shards * s / rates["sparsify"] + messages * s / rates["sparse_unpack"]
    return shards * s * (1 / rates["sparsify"] + 1 / rates["auto_pack"]) \
        + messages * s / rates["auto_decode"]


def _exchange(st: _Step, p: Prediction, t: Compression, g: int, s: int, eb: int, cnt: int,
              rates: Dict[str, float]) -> None:
    """TAGC's compressed reduce-scatter of one unit over all ranks: an all-to-all."""
    if t.vote_bytes:
        st.ring("control", "world", g, "all_reduce", t.vote_bytes, cnt, cnt)
    if t.mode == "dense":  # transports.dense: one all_to_all_single
        st.all_to_all("grad", "world", g, s * eb, 1, cnt)
    elif t.mode == "quant":  # transports.quant: a message per owner, isend/irecv
        fmt = t.quant_format
        st.all_to_all("grad", "world", g, quant_bytes(s, fmt, t.quant_block), 1, cnt, "p2p")
        # the own shard stays exact: g - 1 shards encoded, g - 1 messages decoded
        p.codec_s += (g - 1) * s * (1 / rates[f"quant_encode_{fmt}"]
                                    + 1 / rates[f"quant_decode_{fmt}"])
    else:  # every shard selected (the own one too), g messages added at the owner
        st.all_to_all("grad", "world", g, _pairs_msg(t, s, eb), 1, cnt, "p2p")
        p.codec_s += _pairs_codec(t, s, g, g, rates)


def _cross(st: _Step, p: Prediction, t: Compression, cross: str, r: int, s: int, eb: int,
           cnt: int, rates: Dict[str, float]) -> None:
    """TAGC's HSDP exchange of one rank's shard of one unit between ``r`` replicas, in
    the form :func:`hsdp_form` picks (``tagc/hsdp.py``)."""
    if t.vote_bytes:  # the reducer's vote, once per call whatever the form
        st.ring("control", "replica", r, "all_reduce", t.vote_bytes, cnt, cnt)
    if hsdp_form(cross, t, r, s) == "all-gather":
        # GatherReducer: transports.SPREADS with place=False
        if t.mode == "dense":  # spread_dense: one SUM all-reduce, native HSDP's
            st.ring("cross", "replica", r, "all_reduce", s * eb, 1, cnt)
        elif t.mode == "quant":  # spread_quant: encode the shard once, decode all r
            fmt = t.quant_format
            st.ring("cross", "replica", r, "all_gather", quant_bytes(s, fmt, t.quant_block),
                    1, cnt, tagc=True)
            p.codec_s += s / rates[f"quant_encode_{fmt}"] + r * s / rates[f"quant_decode_{fmt}"]
        else:  # spread_pairs: the k pairs of the shard all-gathered, all r added
            st.ring("cross", "replica", r, "all_gather", _pairs_msg(t, s, eb), 1, cnt, tagc=True)
            p.codec_s += _pairs_codec(t, s, 1, r, rates)
        return
    # TwoPhaseReducer: the shard padded to r chunks; the to-the-owner phase is the mode's
    # FULL_SHARD transport over the replicas (r - 1 point-to-point messages per rank,
    # counted as an all-to-all of the same bytes, timed as p2p), then each owner codes
    # its chunk of the sum once and one all-gather brings every owner's message to every
    # replica (transports.SPREADS with place=True), where all r are decoded.
    chunk = -(-s // r)
    if t.mode == "dense":  # transports.dense, then spread_dense: the fp32 sums gathered
        st.all_to_all("cross", "replica", r, chunk * eb, 1, cnt)
        st.ring("cross", "replica", r, "all_gather", chunk * DTYPE_BYTES["fp32"], 1, cnt, tagc=True)
    elif t.mode == "quant":
        fmt, out = t.quant_format, t.owner_format
        enc, dec = rates[f"quant_encode_{fmt}"], rates[f"quant_decode_{fmt}"]
        st.all_to_all("cross", "replica", r, quant_bytes(chunk, fmt, t.quant_block), 1, cnt,
                      "p2p")
        st.ring("cross", "replica", r, "all_gather", quant_bytes(chunk, out, t.quant_block),
                1, cnt, tagc=True)
        # transports.quant: the own chunk is added exact, the r - 1 others encoded and
        # r - 1 received messages decoded; spread_quant: one chunk encoded, r decoded,
        # on the owner's code
        p.codec_s += (r - 1) * chunk * (1 / enc + 1 / dec) + chunk / rates[f"quant_encode_{out}"] \
            + r * chunk / rates[f"quant_decode_{out}"]
    else:
        # transports.pairs: every chunk selected (the own one too), r messages added at
        # the owner; spread_pairs: k of the owner's sum selected, r messages added
        msg = _pairs_msg(t, chunk, eb)
        st.all_to_all("cross", "replica", r, msg, 1, cnt, "p2p")
        st.ring("cross", "replica", r, "all_gather", msg, 1, cnt, tagc=True)
        p.codec_s += _pairs_codec(t, chunk, r, r, rates) + _pairs_codec(t, chunk, 1, r, rates)


# --------------------------------------------------------------------------- compute time

# Training FLOPs per token and parameter: 2 forward + 4 backward multiply-adds
# (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", C = 6 N D).
FLOPS_PER_PARAM_TOKEN = 6


def flops_compute_s(params: float, tokens_per_rank: int, tflops: float, mfu: float) -> float:
    """Compute time of one step from the 6 x params x tokens estimate.

    Args:
        params: model parameters.
        tokens_per_rank: tokens each rank processes per optimizer step.
        tflops: peak dense TFLOP/s of one rank's device (dtype of the matmuls).
        mfu: achieved fraction of that peak, in (0, 1].
    Returns:
        seconds.
    """
    if tokens_per_rank < 1 or not tflops > 0 or not 0 < mfu <= 1:
        raise ValueError("flops estimate: tokens_per_rank >= 1, tflops > 0 and mfu in (0, 1] "
                         f"needed, got {tokens_per_rank}, {tflops}, {mfu}")
    return FLOPS_PER_PARAM_TOKEN * params * tokens_per_rank / (tflops * 1e12 * mfu)


# --------------------------------------------------------------------------- sweep and report


def sweep(model: ModelSpec, base: Cluster, nodes: Sequence[int], configs: Sequence[Config],
          compute_s: float, codec: Dict[str, float]) -> Dict[str, Dict[int, Prediction]]:
    """Every configuration at every node count.

    Args:
        model: the model.
        base: the cluster (its ``nodes`` is replaced by each of ``nodes``).
        nodes: node counts R.
        configs: configurations.
        compute_s: compute time per step.
        codec: codec throughputs.
    Returns:
        ``{config name: {R: prediction}}``.
    """
    out: Dict[str, Dict[int, Prediction]] = {}
    for cfg in configs:
        out[cfg.name] = {r: predict(model, replace(base, nodes=r), cfg, compute_s, codec)
                         for r in nodes}
    return out


def winner(table: Dict[str, Dict[int, Prediction]], r: int) -> Prediction:
    """The fastest configuration at R = r.

    Args:
        table: :func:`sweep`'s result.
        r: the node count.
    Returns:
        its prediction (the first of the table's order on a tie).
    """
    return min((by_r[r] for by_r in table.values()), key=lambda p: p.step_s)


def _fmt_mb(b: float) -> str:
    """Bytes as MB, 4 significant digits."""
    return f"{b / 1e6:.4g}"


def _ratio(num: float, den: float) -> str:
    """``num / den`` to 4 significant digits, or "-" when either is 0 (nothing sent).

    Args:
        num: the numerator (native HSDP's bytes).
        den: the denominator (the configuration's bytes).
    Returns:
        the text.
    """
    return f"{num / den:.4g}" if num and den else "-"


def report(model: ModelSpec, base: Cluster, nodes: Sequence[int],
           table: Dict[str, Dict[int, Prediction]]) -> str:
    """Markdown tables: bytes per rank, bytes per node between nodes (and their ratio to
    native HSDP's when ``hsdp`` is in the table), step time, winners.

    Args:
        model: the model.
        base: the cluster (ranks per node, links).
        nodes: node counts R (the columns).
        table: :func:`sweep`'s result.
    Returns:
        the text.
    """
    cols = " | ".join(f"R={r} ({r * base.ranks_per_node} ranks)" for r in nodes)
    sep = "|---" * (len(nodes) + 1) + "|"
    first = next(iter(table.values()))[nodes[0]]
    lines = [f"model: {model.name}, {model.params / 1e6:.2f}M parameters, "
             f"{100 * model.compressed_fraction():.1f}% in compressed units, "
             f"{model.unit_count} FSDP units",
             f"cluster: {base.ranks_per_node} ranks per node, intra {base.intra_gbit:g} Gbit/s "
             f"+ {base.intra_latency_s * 1e6:g} us, inter {base.inter_gbit:g} Gbit/s per node "
             f"+ {base.inter_latency_s * 1e6:g} us, backend {base.backend}, overlap "
             f"{base.overlap:g}, link efficiency {base.link_efficiency:g}; compute "
             f"{first.compute_s:.4g} s per step", ""]
    tables: List[Tuple[str, Callable[[Prediction, int], str]]] = [
        ("bytes sent per rank per step (MB)", lambda p, r: _fmt_mb(p.bytes_per_rank)),
        ("bytes per node on the inter-node link per step (MB)",
         lambda p, r: _fmt_mb(p.node_inter)),
        ("predicted step time (s)", lambda p, r: f"{p.step_s:.4g}")]
    native = table.get("hsdp")
    if native is not None:
        # How much less than native HSDP a configuration puts between nodes: the figure
        # HSDP compression is judged by (COST_MODEL.md), exact where the MB above round.
        tables.insert(2, ("native HSDP's inter-node bytes / the configuration's (x)",
                          lambda p, r: _ratio(native[r].node_inter, p.node_inter)))
    for title, fn in tables:
        lines += [f"**{title}**", "", f"| config | {cols} |", sep]
        for by_r in table.values():
            cfg = next(iter(by_r.values())).config
            lines.append(f"| {cfg.name} | " + " | ".join(fn(by_r[r], r) for r in nodes) + " |")
        lines.append("")
    lines.append("**fastest configuration**")
    lines.append("")
    for r in nodes:
        best = winner(table, r)
        lines.append(f"- R={r}: {best.config.name}, {best.step_s:.4g} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------- --check


@dataclass
class CheckRow:
    """One compared quantity.

    Attributes:
        setup: the runs file's setup (or bits section).
        config: configuration or label.
        quantity: what is compared.
        predicted: the model's value.
        measured: the runs file's value.
        decimals: decimals the measurement was printed with (bytes: exact means equal
            at that precision); None for times.
        calibrated: the prediction with the setup's ``calibrate`` figure fitted to its
            plain row (times only).
        calibration_row: the plain row the fit used (its calibrated error is 0 by
            construction).
        fit: (figure, value) the calibration fitted for the row's setup.
    """

    setup: str
    config: str
    quantity: str
    predicted: float
    measured: float
    decimals: Optional[int] = None
    calibrated: Optional[float] = None
    calibration_row: bool = False
    fit: Optional[Tuple[str, float]] = None

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured if self.measured else \
            (0.0 if self.predicted == 0 else math.inf)

    @property
    def exact(self) -> bool:
        """Equal at the printed precision (bytes)."""
        if self.decimals is None:
            return False
        return abs(self.predicted - self.measured) <= 0.5 * 10 ** -self.decimals + 1e-12

    @property
    def calibrated_error(self) -> Optional[float]:
        """Error of the calibrated prediction."""
        if self.calibrated is None:
            return None
        return (self.calibrated - self.measured) / self.measured


def load_runs(path: str) -> Dict[str, Any]:
    """Read and validate a runs file (``docs/cost_model_runs.json``'s format).

    Args:
        path: the file.
    Returns:
        the parsed file.
    Raises:
        ValueError: a field missing or of the wrong kind, naming it.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"runs file {path}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("setups"), dict) \
            or not isinstance(data.get("runs"), list):
        raise ValueError(f"runs file {path}: needs a 'setups' object and a 'runs' list")
    for name, st in data["setups"].items():
        for k in ("model", "fsdp", "layout", "dtype", "ranks_per_node", "nodes",
                  "inter_mbit", "compute"):
            if k not in st:
                raise ValueError(f"runs file {path}: setup {name!r} lacks {k!r}")
        if st["model"] not in RUN_MODELS:
            raise ValueError(f"runs file {path}: setup {name!r}: unknown model "
                             f"{st['model']!r}; known: {sorted(RUN_MODELS)}")
        c = st["compute"]
        if "rest_s" not in c and not ("plain_fast_step_s" in c and "fast_mbit" in c):
            raise ValueError(f"runs file {path}: setup {name!r}: compute needs rest_s, or "
                             "plain_fast_step_s and fast_mbit")
    links = data.get("links", {})
    if not isinstance(links, dict):
        raise ValueError(f"runs file {path}: 'links' must map names to bench_collectives.py "
                         "outputs")
    for lname, rep in links.items():
        try:
            CollectiveRates.from_report(rep, lname)
        except (ValueError, TypeError) as e:
            raise ValueError(f"runs file {path}: link table {lname!r}: {e}") from e
    for name, st in data["setups"].items():
        if "collectives" in st and st["collectives"] not in links:
            raise ValueError(f"runs file {path}: setup {name!r} names unknown link table "
                             f"{st['collectives']!r}")
    for i, run in enumerate(data["runs"]):
        if run.get("setup") not in data["setups"]:
            raise ValueError(f"runs file {path}: run {i} names unknown setup {run.get('setup')!r}")
        if "config" not in run or "step_s" not in run:
            raise ValueError(f"runs file {path}: run {i} needs 'config' and 'step_s'")
    for sec in data.get("bits_per_param", []):
        if sec.get("model") not in RUN_MODELS or sec.get("kind") not in ("grad", "gather") \
                or not isinstance(sec.get("rows"), list):
            raise ValueError(f"runs file {path}: a bits_per_param section needs a known "
                             "model, kind grad|gather and rows")
    return data


def _setup_cluster(st: Dict[str, Any], inter_mbit: float, intra_mbit: Optional[float] = None,
                   efficiency: float = 1.0, collectives: Optional[CollectiveRates] = None
                   ) -> Cluster:
    """The cluster of a runs-file setup (gloo), at ``inter_mbit`` between nodes."""
    n = st["ranks_per_node"]
    intra = intra_mbit if intra_mbit is not None else st.get("intra_mbit")
    if intra is None:
        if n > 1:
            raise ValueError("a setup with several ranks per node needs intra_mbit")
        intra = inter_mbit  # unused: no intra-node link with one rank per node
    # Latency: scripts/bench_step.py's --delay default (0.1 ms), which this kernel's tbf
    # does not apply (no sch_netem, DESIGN section 10): an upper bound, a few ms per step.
    return Cluster(n, st["nodes"], intra / 1000, inter_mbit / 1000, 1e-4, 1e-4,
                   backend="gloo", link_efficiency=efficiency, collectives=collectives,
                   pair_gather=st.get("pair_gather", True),
                   ring_exchange=st.get("ring_exchange", True))


def _run_config(st: Dict[str, Any], name: str) -> Config:
    """A runs-file row's configuration: ``fsdp`` is the setup's plain layout."""
    layout = "hsdp" if st["layout"] == "hsdp" else "fsdp"
    full = layout if name == "fsdp" else f"{layout}+{name}"
    return make_config(full, st["dtype"], st["fsdp"])


def _setup_state(st: Dict[str, Any], model: ModelSpec, codec: Optional[Dict[str, float]],
                 efficiency: float = 1.0, intra_mbit: Optional[float] = None,
                 collectives: Optional[CollectiveRates] = None) -> Tuple[Cluster, float]:
    """(cluster, compute seconds) of a setup.

    Compute is the plain row's time outside collectives (``rest_s``), or the plain
    step on the fast link minus the communication predicted there (without the
    measured collective rates, which are of the slow link).
    """
    cl = _setup_cluster(st, st["inter_mbit"], intra_mbit, efficiency, collectives)
    c = st["compute"]
    if "rest_s" in c:
        return cl, float(c["rest_s"])
    fast = _setup_cluster(st, c["fast_mbit"], intra_mbit, efficiency)
    fast = replace(fast, intra_gbit=max(fast.intra_gbit, c["fast_mbit"] / 1000))
    comm = predict(model, fast, _run_config(st, "fsdp"), 0.0, codec).comm_s
    return cl, c["plain_fast_step_s"] - comm


# The figure a setup may fit to its plain row: (search range, keyword of _setup_state).
CALIBRATABLE = {"link_efficiency": ((0.05, 1.0), "efficiency"),
                "intra_mbit": ((10.0, 1e6), "intra_mbit")}


def calibrate(st: Dict[str, Any], model: ModelSpec, codec: Optional[Dict[str, float]],
              measured_plain_s: float, collectives: Optional[CollectiveRates] = None
              ) -> Optional[Tuple[str, float]]:
    """Fit the setup's ``calibrate`` figure so the plain row's step time is matched.

    The predicted plain step falls as the figure grows (more efficiency, a faster
    link), so a bisection finds it; at a bound of the range the bound is kept.

    Args:
        st: the setup (``calibrate``: ``link_efficiency``, the default, or
            ``intra_mbit``).
        model: its model.
        codec: codec throughputs.
        measured_plain_s: the plain row's measured step time.
        collectives: the setup's measured collective rates, if any.
    Returns:
        (figure, fitted value), or None when the setup has no plain row.
    """
    name = st.get("calibrate", "link_efficiency")
    if name not in CALIBRATABLE:
        raise ValueError(f"calibrate: one of {sorted(CALIBRATABLE)}, got {name!r}")
    (lo, hi), kw = CALIBRATABLE[name]
    plain = _run_config(st, "fsdp")

    def step(x: float) -> float:
        """The predicted plain step at figure value x."""
        cl, compute = _setup_state(st, model, codec, collectives=collectives, **{kw: x})
        if compute < 0:  # so slow a link that the fast-link step holds no compute
            return math.inf
        return predict(model, cl, plain, compute, codec).step_s

    if step(hi) >= measured_plain_s:
        return name, hi
    if step(lo) <= measured_plain_s:
        return name, lo
    for _ in range(100):
        mid = math.sqrt(lo * hi)  # geometric: the range spans decades
        lo, hi = (mid, hi) if step(mid) > measured_plain_s else (lo, mid)
    return name, math.sqrt(lo * hi)


def check(data: Dict[str, Any], codec: Optional[Dict[str, float]] = None) -> List[CheckRow]:
    """Predictions against every measured number of a runs file.

    Step time, first principles: the setup's links as given, compute from the setup
    (:func:`_setup_state`).  Calibrated: the setup's ``calibrate`` figure fitted to its
    plain row (:func:`calibrate`), the other rows predicted with it.

    Args:
        data: :func:`load_runs`'s result.
        codec: codec throughputs (default: this machine's, where the runs ran).
    Returns:
        one row per compared quantity.
    """
    rows: List[CheckRow] = []
    links = {k: CollectiveRates.from_report(v, k) for k, v in data.get("links", {}).items()}
    for name, st in data["setups"].items():
        model = run_model(st["model"])
        coll = links[st["collectives"]] if "collectives" in st else None
        cl, compute = _setup_state(st, model, codec, collectives=coll)
        runs = [r for r in data["runs"] if r["setup"] == name]
        meas_plain = next((r["step_s"] for r in runs if r["config"] == "fsdp"), None)
        fit = calibrate(st, model, codec, meas_plain, coll) if meas_plain else None
        cal = _setup_state(st, model, codec, collectives=coll,
                           **{CALIBRATABLE[fit[0]][1]: fit[1]}) if fit else None
        for run in runs:
            cfg = _run_config(st, run["config"])
            p = predict(model, cl, cfg, compute, codec)
            pc = predict(model, cal[0], cfg, cal[1], codec).step_s if cal else None
            hook = (p.ideal.get("cross", 0.0) if cfg.layout == "hsdp" else
                    p.ideal.get("grad", 0.0)) + p.ideal.get("control", 0.0)
            label = cfg.name
            for key, pred, dec in (("stats_wire_mb", hook / 1e6, 2),
                                   ("gathers_mb", p.ideal.get("gather", 0.0) / 1e6, 2),
                                   ("veth_tx_mb", p.node_inter * TCP_FRAME_OVERHEAD / 1e6, None)):
                if key in run:
                    rows.append(CheckRow(name, label, key, pred, run[key], dec))
            rows.append(CheckRow(name, label, "step_s", p.step_s, run["step_s"], None, pc,
                                 run["config"] == "fsdp", fit))
            if "in_collectives_s" in run:
                rows.append(CheckRow(name, label, "in_collectives_s", p.comm_s,
                                     run["in_collectives_s"]))
            if "codec_s" in run:
                rows.append(CheckRow(name, label, "codec_s", p.codec_s, run["codec_s"]))
    for sec in data.get("bits_per_param", []):
        model = run_model(sec["model"])
        dec = int(sec.get("decimals", 2))
        for row in sec["rows"]:
            comp = Compression(**row["compression"]) if row["compression"] else None
            cfg = Config(row["label"], "full_shard", comp, fsdp=sec["fsdp"])
            cl = Cluster(row["n"], 1, 1.0, 1.0)
            if sec["kind"] == "grad":  # the compressed units only, as the hook counts them
                units = tuple(u for u in model.units if u.compressed)
                p = predict(ModelSpec(model.name, units), cl, cfg)
                b = p.ideal.get("grad", 0.0) + p.ideal.get("control", 0.0)
                params = sum(u.numel for u in units)
            else:
                p = predict(model, cl, cfg)
                b, params = p.ideal.get("gather", 0.0), model.params
            rows.append(CheckRow(sec["section"].lstrip("# "), row["label"],
                                 f"bits/param N={row['n']}", 8 * b / params, row["bits"], dec))
    return rows


def _pct(x: Optional[float]) -> str:
    """A signed percentage, or "-"."""
    return "-" if x is None else f"{100 * x:+.1f}%"


def check_report(rows: List[CheckRow], tolerance: float = 0.25) -> str:
    """The --check tables (markdown) and a summary of what holds.

    Args:
        rows: :func:`check`'s result.
        tolerance: the step-time goal (0.25: within 25%).
    Returns:
        the text.
    """
    out = ["**bytes: predicted vs measured** (exact = equal at the printed precision; "
           "veth = the link's counter, TCP/IP framing added as 1514/1448)", "",
           "| setup | config | quantity | predicted | measured | error | match |",
           "|---|---|---|---|---|---|---|"]
    byte_rows = [r for r in rows if r.quantity in ("stats_wire_mb", "gathers_mb", "veth_tx_mb")
                 or r.quantity.startswith("bits/param")]
    for r in byte_rows:
        match = ("exact" if r.exact else "NOT exact") if r.decimals is not None else \
            ("within 1%" if abs(r.error) <= 0.01 else "off by more than 1%")
        dec = 3 if r.decimals is None else max(r.decimals, 2) + 1
        out.append(f"| {r.setup} | {r.config} | {r.quantity} | {r.predicted:.{dec}f} | "
                   f"{r.measured:g} | {_pct(r.error)} | {match} |")
    out += ["", "**step time: predicted vs measured** (first principles; calibrated = the "
            "setup's one unmeasured figure fitted to its plain row, marked *)", "",
            "| setup | config | measured s | predicted s | error | calibrated s | error | "
            "in collectives pred / meas s | codec pred / meas s |",
            "|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r.setup, r.config, r.quantity): r for r in rows}
    time_rows = [r for r in rows if r.quantity == "step_s"]
    for r in time_rows:
        coll = by_key.get((r.setup, r.config, "in_collectives_s"))
        cod = by_key.get((r.setup, r.config, "codec_s"))
        cal = "-" if r.calibrated is None else f"{r.calibrated:.3f}" + ("*" if r.calibration_row
                                                                       else "")
        out.append(f"| {r.setup} | {r.config} | {r.measured:.3f} | {r.predicted:.3f} | "
                   f"{_pct(r.error)} | {cal} | {_pct(r.calibrated_error)} | "
                   + (f"{coll.predicted:.3f} / {coll.measured:.3f}" if coll else "-") + " | "
                   + (f"{cod.predicted:.3f} / {cod.measured:.3f}" if cod else "-") + " |")
    fits = {r.setup: r.fit for r in time_rows if r.fit}
    out += ["", "calibration, per setup (fitted to its plain row): " + "; ".join(
        f"{k}: {f[0]} = {f[1]:.3g}" for k, f in fits.items())]
    exact = [r for r in byte_rows if r.decimals is not None]
    veth = [r for r in byte_rows if r.decimals is None]
    held = [r for r in time_rows if not r.calibration_row and r.calibrated is not None]
    ok = sum(abs(r.error) <= tolerance for r in time_rows)
    ok_cal = sum(abs(r.calibrated_error or 0) <= tolerance for r in held)
    out += ["", "**summary**", "",
            f"- bytes exact at the printed precision: {sum(r.exact for r in exact)} of "
            f"{len(exact)}",
            f"- veth bytes within 1%: {sum(abs(r.error) <= 0.01 for r in veth)} of {len(veth)} "
            f"(largest error {_pct(max((abs(r.error) for r in veth), default=0))})",
            f"- step time within {tolerance:.0%}, first principles: {ok} of {len(time_rows)}",
            f"- step time within {tolerance:.0%}, calibrated on the plain row (that row "
            f"left out): {ok_cal} of {len(held)}"]
    return "\n".join(out)


# --------------------------------------------------------------------------- plot


def plot(path: str, base: Cluster, nodes: Sequence[int], configs: Sequence[Config],
         models: Sequence[Tuple[ModelSpec, float]], codec: Dict[str, float],
         note: str) -> None:
    """Bytes per rank and step time against R for each model (matplotlib, lazily).

    Args:
        path: the PNG to write.
        base: the cluster.
        nodes: node counts R.
        configs: configurations.
        models: (model, compute seconds per step) pairs, one column each.
        codec: codec throughputs.
        note: the assumptions, printed under the figure.
    """
    import matplotlib  # noqa: PLC0415 - only the --plot path needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8.5), squeeze=False)
    for col, (model, compute) in enumerate(models):
        table = sweep(model, base, nodes, configs, compute, codec)
        for cfg in configs:
            by_r = table[cfg.name]
            axes[0][col].plot(nodes, [by_r[r].bytes_per_rank / 1e6 for r in nodes], "-",
                              marker="o", ms=3, label=cfg.name)
            axes[1][col].plot(nodes, [by_r[r].step_s for r in nodes], "-", marker="o",
                              ms=3, label=cfg.name)
        axes[0][col].set_title(f"{model.name}: bytes sent per rank per step")
        axes[1][col].set_title(f"{model.name}: step time (compute {compute:.3g} s)")
        axes[0][col].set_ylabel("MB per rank per step")
        axes[1][col].set_ylabel("seconds per step")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(f"nodes R ({base.ranks_per_node} ranks per node)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="best")
    fig.text(0.01, 0.005, note, fontsize=7, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def _int_list(text: str) -> List[int]:
    """argparse type: comma-separated node counts >= 1."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"node counts must be >= 1, got {text!r}")
    return out


def _codec_overrides(items: Iterable[str]) -> Dict[str, float]:
    """``--codec OP=VALUE`` items as a dict (checked by :func:`codec_rates`)."""
    out = {}
    for it in items:
        key, eq, val = it.partition("=")
        if not eq:
            raise ValueError(f"--codec: expected OP=VALUES_PER_S, got {it!r}")
        try:
            out[key] = float(val)
        except ValueError as e:
            raise ValueError(f"--codec {key}: not a number: {val!r}") from e
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="configurations: fsdp, hsdp, fsdp+P, hsdp+P (the hook's "
                                       "hsdp_allreduce=auto), hsdp+P/2phase, hsdp+P/gather "
                                       f"with P in {sorted(PRESETS)}; codec ops: "
                                       f"{', '.join(sorted(DEFAULT_CODEC))}")
    m = p.add_argument_group("model")
    m.add_argument("--params", type=float, help="parameters (e.g. 124e6, 7e9)")
    m.add_argument("--model", choices=sorted(MODELS),
                   help="a GPT-2 layout of this repository instead of --params")
    m.add_argument("--layers", choices=LAYER_POLICIES, default=DEFAULT_LAYERS,
                   help=f"selection policy of --model, of --plot's GPT-2 124M and of "
                        f"--params' default fraction (default {DEFAULT_LAYERS}, the one "
                        "tagc-balanced/lean/full use; non_attention: the attention QKV "
                        "inputs uncompressed, as before the presets changed and as "
                        "tagc-sparse/auto/dense still do).  It applies to every "
                        "configuration of the run; --check ignores it (each measured run "
                        "names its own layout)")
    m.add_argument("--selected-fraction", type=float, default=None,
                   help="with --params (and the 7B of --plot): fraction of parameters in "
                        "compressed units (default: the tiny GPT-2's under --layers, "
                        f"{default_selected_fraction('all'):.3f} for all, "
                        f"{default_selected_fraction('non_attention'):.3f} for "
                        "non_attention)")
    m.add_argument("--units", type=int, default=DEFAULT_UNITS,
                   help=f"with --params: FSDP units (default {DEFAULT_UNITS}, GPT-2 124M's)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                   help="node counts R, comma-separated")
    c.add_argument("--ranks-per-node", type=int, default=8, help="N (default 8)")
    c.add_argument("--intra-gbit", type=float, default=400.0,
                   help="per-rank bandwidth inside a node, Gbit/s (default 400)")
    c.add_argument("--inter-gbit", type=float, default=25.0,
                   help="per-node bandwidth between nodes, Gbit/s (default 25)")
    c.add_argument("--intra-latency-us", type=float, default=5.0,
                   help="per message inside a node (default 5 us)")
    c.add_argument("--inter-latency-us", type=float, default=30.0,
                   help="per message between nodes (default 30 us)")
    c.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    c.add_argument("--overlap", type=float, default=0.0,
                   help="fraction of compute that hides communication, 0..1 (default 0)")
    c.add_argument("--link-efficiency", type=float, default=1.0,
                   help="fraction of the bandwidth collectives reach (default 1)")
    c.add_argument("--collectives", metavar="JSON",
                   help="measured collective rates (scripts/bench_collectives.py --out) of "
                        "your cluster: they replace the link bandwidths where they cover a "
                        "collective (measured at one R: predictions at other R reuse them)")
    w = p.add_argument_group("workload")
    w.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated configurations")
    w.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp32",
                   help="parameter/gradient dtype on the wire")
    w.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    w.add_argument("--compute-s", type=float, help="compute time per step (measured plain "
                   "step on a fast link)")
    w.add_argument("--tflops", type=float, help="peak TFLOP/s per rank: compute from "
                   "6 x params x tokens")
    w.add_argument("--mfu", type=float, default=0.4, help="with --tflops (default 0.4)")
    w.add_argument("--tokens-per-rank", type=int, default=8192,
                   help="with --tflops: tokens per rank per step (default 8 x 1024)")
    w.add_argument("--codec", action="append", default=[], metavar="OP=VALUES_PER_S",
                   help="codec throughput of one op (repeatable)")
    w.add_argument("--codec-speedup", type=float, default=1.0,
                   help="factor on the measured CPU codec throughputs (e.g. a GPU's)")
    a = p.add_argument_group("actions")
    a.add_argument("--check", metavar="FILE", help="compare with measured runs (JSON)")
    a.add_argument("--plot", metavar="PNG", help="bytes/rank and step time vs R for GPT-2 "
                   "124M and a 7B model")
    a.add_argument("--plot-7b-units", type=int, default=32 * 7 + 3,
                   help="FSDP units of the 7B model in --plot (default 227: a Llama-2-7B "
                        "under TAGC's wrapping, 7 linear units per layer + embedding, head, "
                        "root)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the arguments and print the tables, the check or the plot.

    Args:
        argv: arguments (default sys.argv[1:]).
    Returns:
        the exit code.
    """
    p = build_parser()
    args = p.parse_args(argv)
    try:
        codec = codec_rates(_codec_overrides(args.codec), args.codec_speedup)
        if args.check:
            print(check_report(check(load_runs(args.check), codec)))
            return 0
        coll = None
        if args.collectives:
            try:
                coll = CollectiveRates.from_report(json.loads(Path(args.collectives).read_text()),
                                                   args.collectives)
            except (OSError, ValueError) as e:
                p.error(f"--collectives {args.collectives}: {e}")
        base = Cluster(args.ranks_per_node, 1, args.intra_gbit, args.inter_gbit,
                       args.intra_latency_us * 1e-6, args.inter_latency_us * 1e-6,
                       args.backend, args.overlap, args.link_efficiency, coll)
        configs = [make_config(n.strip(), args.dtype, args.fsdp)
                   for n in args.configs.split(",") if n.strip()]
        if not configs:
            raise ValueError("--configs: no configuration given")
        fraction = (default_selected_fraction(args.layers) if args.selected_fraction is None
                    else args.selected_fraction)
        if args.plot:
            if args.tflops is None:
                raise ValueError("--plot draws two models: give --tflops (and --mfu, "
                                 "--tokens-per-rank) for their compute time")
            m124 = gpt2_124m(args.layers)
            m7 = generic_model(7e9, fraction, args.plot_7b_units, name="7B")
            pairs = [(m, flops_compute_s(m.params, args.tokens_per_rank, args.tflops, args.mfu))
                     for m in (m124, m7)]
            note = (f"{base.ranks_per_node} ranks/node; intra {base.intra_gbit:g} Gbit/s/rank, "
                    f"inter {base.inter_gbit:g} Gbit/s/node; {args.backend}, {args.dtype}; overlap "
                    f"{args.overlap:g}; compute 6 x params x {args.tokens_per_rank} tokens at "
                    f"{args.tflops:g} TFLOP/s x MFU {args.mfu:g}; codec: this CPU's measured "
                    f"throughput x {args.codec_speedup:g}; layers={args.layers}; 7B: "
                    f"{fraction:.3f} of parameters compressed. hsdp+P: the hook's default "
                    "form (all-gather at R = 2, two-phase from R = 3, lean from 4); /gather: the "
                    "all-gather form forced.")
            plot(args.plot, base, args.nodes, configs, pairs, codec, note)
            print(f"wrote {args.plot}")
            return 0
        if args.model and args.params:
            raise ValueError("give --params or --model, not both")
        if args.model:
            model = MODELS[args.model](layers=args.layers)
        elif args.params:
            model = generic_model(args.params, fraction, args.units)
        else:
            raise ValueError("give --params N (or --model NAME)")
        if args.compute_s is not None:
            compute = args.compute_s
        elif args.tflops is not None:
            compute = flops_compute_s(model.params, args.tokens_per_rank, args.tflops, args.mfu)
        else:
            compute = 0.0
            print("note: no --compute-s or --tflops: compute time 0 (communication and codec "
                  "only)\n")
        print(report(model, base, args.nodes, sweep(model, base, args.nodes, configs, compute,
                                                      codec)))
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # `cost_model.py ... | head` closed the pipe: point stdout at /dev/null so the
        # interpreter's flush at exit does not raise again (the `signal` docs' recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
