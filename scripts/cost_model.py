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
* ``hsdp+<preset>``: TAGC's HSDP route (``tagc/hsdp.py``): every rank all-gathers its
  compressed shard to the ``R-1`` other replicas (implemented);
* ``hsdp+<preset>/2phase``: a compressed reduce-scatter over the replicas followed
  by an all-gather of the re-compressed sums (about ``2(R-1)/R`` of one compressed
  shard per rank instead of ``R-1``): **modelled, not implemented** in the hook.

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
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

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

# Fraction of the parameters in compressed units for a model given only by its size:
# the tiny GPT-2 of the quality runs (configs/train-tiny.yaml: 2 layers, width 256,
# block 128, byte tokenizer padded to 320 ids) under the default `non_attention`
# policy: everything but the two attention QKV units (2 x 197,376 of 1,694,720
# parameters) is compressed; `tiny_gpt2().compressed_fraction()` recomputes it.
DEFAULT_SELECTED_FRACTION = 1_299_968 / 1_694_720  # 0.767

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
_S24 = float(2 ** 24)
DEFAULT_CODEC = {
    "quant_encode_int4": _S24 / 15.789e-3,
    "quant_encode_ternary": _S24 / 16.612e-3,
    "quant_encode_int8": _S24 / 15.789e-3,
    "quant_encode_sign": _S24 / 15.789e-3,
    "quant_decode_int4": _S24 / 5.115e-3,
    "quant_decode_ternary": _S24 / 14.828e-3,
    "quant_decode_int8": _S24 / 5.115e-3,
    "quant_decode_sign": _S24 / 5.115e-3,
    "sparsify": _S24 / 15.653e-3,
    "sparse_unpack": _S24 / 2.152e-3,
    "auto_pack": _S24 / 0.708e-3,
    "auto_decode": _S24 / 4.867e-3,
    "wq_encode": _S24 / (17.062e-3 / 2),
    "wq_decode": _S24 / (17.062e-3 / 2),
}

LABEL_NOT_IMPLEMENTED = "modelled, not implemented"


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
    """Elias-Fano low bits for k positions in n (``tagc_check_ef_low_bits``)."""
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
    """One FSDP unit (or ``count`` identical ones).

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
        """
        if fsdp == 1:
            return [-(-self.numel // n)]
        return [-(-r // n) * c for r, c in self.params]

    def shard(self, n: int, fsdp: int = 2) -> int:
        """Elements of one rank's shard over ``n`` ranks."""
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


def generic_model(params: float, selected_fraction: float = DEFAULT_SELECTED_FRACTION,
                  units: int = DEFAULT_UNITS, name: Optional[str] = None) -> ModelSpec:
    """A model known by its size: one compressed and one plain aggregate unit.

    Byte counts are then exact up to the per-unit rounding (block tails, shard
    padding), which is below one block per unit and rank.

    Args:
        params: parameters (> 0).
        selected_fraction: fraction of them in compressed units, in [0, 1].
        units: FSDP units (>= 1): the compressed ones get ``round(fraction * units)``
            of them (at least one when the fraction is above 0).
        name: for reports.
    Returns:
        the model.
    """
    if not params > 0 or not math.isfinite(params):
        raise ValueError(f"params must be a positive number, got {params!r}")
    if not 0.0 <= selected_fraction <= 1.0:
        raise ValueError(f"selected fraction must be in [0, 1], got {selected_fraction!r}")
    if units < 1:
        raise ValueError(f"units must be >= 1, got {units}")
    total = int(round(params))
    comp = int(round(total * selected_fraction))
    n_comp = min(units, max(1, round(selected_fraction * units))) if comp else 0
    n_plain = units - n_comp
    if comp < total and n_plain == 0:  # the plain rest needs a unit of its own
        n_comp, n_plain = units - 1, 1
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
        return sum(self.unit_counts)


def gpt2_model(n_layer: int, n_embd: int, vocab_size: int, block_size: int,
               layers: str = "non_attention", min_numel: int = DEFAULT_MIN_NUMEL,
               name: Optional[str] = None) -> ModelSpec:
    """A GPT-2 (``scripts/gpt2_model.py``: biases, tied head) as TAGC wraps it.

    Follows ``tagc/selection.py``: a module gets its own unit if it owns a selected
    parameter or is a linear/embedding layer of at least ``min_numel`` parameters
    (or an attention QKV projection); the tied wte stays in the root with everything
    else (position embedding if small, LayerNorms).  A unit is compressed when its
    selected parameters are at least half of it.

    Args:
        n_layer, n_embd, vocab_size, block_size: the shape.
        layers: ``non_attention`` (default) or ``all``.
        min_numel: smallest parameter compressed.
        name: for reports.
    Returns:
        the model.
    """
    for k, v in (("n_layer", n_layer), ("n_embd", n_embd), ("vocab_size", vocab_size),
                 ("block_size", block_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive int, got {v!r}")
    if layers not in ("non_attention", "all"):
        raise ValueError(f"layers must be 'non_attention' or 'all', got {layers!r}")
    e = n_embd

    def sel(numel: int, weight: bool, qkv: bool) -> bool:
        # tagc/selection.py select_parameter: size first, then (non_attention) a
        # linear/embedding weight that is not a QKV projection
        if numel < min_numel:
            return False
        return True if layers == "all" else (weight and not qkv)

    def linear(nm: str, out_f: int, in_f: int, qkv: bool = False) -> Optional[Unit]:
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


def bench_gpt2() -> ModelSpec:
    """The step benchmark's model (``scripts/bench_step.py`` ModelShape defaults)."""
    return gpt2_model(2, 512, 16384, 64, name="bench GPT-2 (2x512, vocab 16384)")


def tiny_gpt2() -> ModelSpec:
    """The quality runs' tiny GPT-2 (``configs/train-tiny.yaml``: model tiny = 2 layers,
    width 256, block 128; byte tokenizer of 257 ids padded to a multiple of 64)."""
    return gpt2_model(2, 256, 320, 128, name="tiny GPT-2")


def gpt2_124m() -> ModelSpec:
    """GPT-2 small (``scripts/gpt2_model.py`` GPTConfig defaults: 12x768, vocab 50304,
    block 1024)."""
    return gpt2_model(12, 768, 50304, 1024, name="GPT-2 124M")


def linear_pair_model(width: int = 512) -> ModelSpec:
    """``scripts/measure_bytes.py``'s model: Linear(w, 4w) and Linear(4w, w), no bias,
    ``layers: all``, ``min_numel`` 4096: two compressed units and an empty root."""
    return ModelSpec(f"Linear {width}x{4 * width} pair",
                     (Unit("fc1", ((4 * width, width),), True),
                      Unit("fc2", ((width, 4 * width),), True)))


MODELS = {"bench": bench_gpt2, "tiny": tiny_gpt2, "gpt2-124m": gpt2_124m,
          "linear-pair": linear_pair_model}


def unit_counts(model: ModelSpec) -> List[int]:
    """FSDP units each entry of ``model.units`` stands for."""
    if isinstance(model, CountedModel):
        return list(model.unit_counts)
    return [1] * len(model.units)


# --------------------------------------------------------------------------- cluster


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
            (0: nothing hidden, as measured with gloo on the CPU; 1: a step takes
            ``max(compute, communication)`` plus the codec).
        link_efficiency: fraction of the bandwidth collectives reach, in (0, 1]
            (1: first principles; ``--calibrate`` fits it to a measured plain step).
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
        """Payload bytes per second of the intra- or inter-node link."""
        gbit = self.inter_gbit if inter else self.intra_gbit
        return gbit * 1e9 / 8 * self.link_efficiency


# --------------------------------------------------------------------------- configurations

QUANT_MODES = ("quant",)
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
    """

    mode: str
    quant_format: str = "int4"
    quant_block: int = 256
    theta: float = 0.9875
    value_bytes: int = 4
    ef21: bool = False
    gather: str = "none"
    gather_block: int = 256

    def __post_init__(self) -> None:
        if self.mode not in GRAD_MODES:
            raise ValueError(f"unknown mode {self.mode!r}; modelled: {list(GRAD_MODES)} "
                             "(exact and paper send data-dependent bytes)")
        if self.quant_format not in QUANT_CODES_PER_BYTE:
            raise ValueError(f"unknown quant format {self.quant_format!r}; known: "
                             f"{sorted(QUANT_CODES_PER_BYTE)}")
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
    "lean": Compression("quant", "ternary", ef21=True),                # tagc-lean.yaml
    "full": Compression("quant", "int4", ef21=True, gather="int8"),    # tagc-full.yaml
}


@dataclass(frozen=True)
class Config:
    """One way to run a step.

    Args:
        name: for reports.
        layout: ``full_shard`` (FSDP over every rank) or ``hsdp`` (FSDP inside a node,
            replicas across nodes).
        tagc: TAGC's compression, or None for plain FSDP/HSDP.
        cross: HSDP's exchange between replicas with TAGC: ``all-gather`` (implemented)
            or ``two-phase`` (modelled, not implemented).
        dtype: parameter and gradient dtype on the wire, ``fp32`` or ``bf16``
            (FSDP2 MixedPrecisionPolicy param_dtype = reduce_dtype).
        fsdp: 1 or 2 (FSDP1 gathers the root once per step; no gathers hook, no HSDP).
    """

    name: str
    layout: str
    tagc: Optional[Compression] = None
    cross: str = "all-gather"
    dtype: str = "fp32"
    fsdp: int = 2

    def __post_init__(self) -> None:
        if self.layout not in ("full_shard", "hsdp"):
            raise ValueError(f"layout must be 'full_shard' or 'hsdp', got {self.layout!r}")
        if self.cross not in ("all-gather", "two-phase"):
            raise ValueError(f"cross must be 'all-gather' or 'two-phase', got {self.cross!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.fsdp not in (1, 2):
            raise ValueError(f"fsdp must be 1 or 2, got {self.fsdp!r}")
        if self.fsdp == 1 and self.layout == "hsdp":
            raise ValueError("FSDP1 refuses comm hooks on HYBRID_SHARD: HSDP needs fsdp=2")
        if self.fsdp == 1 and self.tagc is not None and self.tagc.gather != "none":
            raise ValueError("quantized gathers need FSDP2 (FSDP1 has no all-gather hook)")
        if self.cross == "two-phase" and (self.layout != "hsdp" or self.tagc is None
                                          or self.tagc.mode != "quant"):
            raise ValueError("the two-phase exchange is modelled for HSDP with a quant "
                             "mode only")

    @property
    def implemented(self) -> bool:
        """False for what the hook does not do yet (the two-phase exchange)."""
        return self.cross != "two-phase"

    @property
    def label(self) -> str:
        """The name, marked when it is not implemented."""
        return self.name if self.implemented else f"{self.name} ({LABEL_NOT_IMPLEMENTED})"


def make_config(name: str, dtype: str = "fp32", fsdp: int = 2) -> Config:
    """A configuration from its name: ``fsdp``, ``hsdp``, ``fsdp+PRESET``,
    ``hsdp+PRESET`` or ``hsdp+PRESET/2phase`` (PRESET one of :data:`PRESETS`).

    Args:
        name: the name.
        dtype: ``fp32`` or ``bf16``.
        fsdp: 1 or 2.
    Returns:
        the configuration.
    """
    base, _, topo = name.partition("/")
    layout_s, _, preset = base.partition("+")
    layouts = {"fsdp": "full_shard", "hsdp": "hsdp"}
    if layout_s not in layouts or (preset and preset not in PRESETS) \
            or topo not in ("", "2phase") or (topo and not preset):
        raise ValueError(f"unknown configuration {name!r}: use fsdp, hsdp, fsdp+P, hsdp+P or "
                         f"hsdp+P/2phase with P one of {sorted(PRESETS)}")
    return Config(name, layouts[layout_s], PRESETS[preset] if preset else None,
                  "two-phase" if topo else "all-gather", dtype, fsdp)


DEFAULT_CONFIGS = ("fsdp", "hsdp", "fsdp+balanced", "fsdp+lean", "fsdp+full",
                   "hsdp+balanced", "hsdp+lean", "hsdp+balanced/2phase", "hsdp+lean/2phase")


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
                 nic: float, steps: int, times: int, lat: int) -> None:
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
        """
        c, p = self.c, self.p
        p.ideal[cat] = p.ideal.get(cat, 0.0) + ideal * times
        p.link[cat] = p.link.get(cat, 0.0) + link * times
        t = intra / c.bytes_per_s(False) if intra else 0.0
        if crosses:
            t = max(t, nic / c.bytes_per_s(True))
            p.node_inter += nic * times
        p.comm_s += t * times + steps * lat * (c.inter_latency_s if crosses
                                                else c.intra_latency_s)
        p.messages += steps * lat

    def _crosses(self, group: str) -> bool:
        return group == "replica" or (group == "world" and self.c.nodes > 1)

    def ring(self, cat: str, group: str, g: int, kind: str, nbytes: float, times: int,
             lat: int) -> None:
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
        """
        if g <= 1 or nbytes == 0:
            return
        if kind == "all_gather":
            ideal = link = (g - 1) * nbytes
            steps = g - 1
        elif kind == "reduce_scatter":
            ideal = (g - 1) / g * nbytes
            gloo = self.c.backend == "gloo"  # gloo: an all-reduce underneath
            link = 2 * ideal if gloo else ideal
            steps = 2 * (g - 1) if gloo else g - 1
        elif kind == "all_reduce":
            ideal = link = 2 * (g - 1) / g * nbytes
            steps = 2 * (g - 1)
        else:
            raise ValueError(f"unknown collective {kind!r}")
        crosses = self._crosses(group)
        # A node-contiguous ring crosses each node boundary once, so a node's link
        # carries one rank's bytes; replica groups: the node's N rings all cross it.
        nic = link * (self.c.ranks_per_node if group == "replica" else 1)
        intra = link if group != "replica" and self.c.ranks_per_node > 1 else 0.0
        self._account(cat, ideal, link, crosses, intra, nic, steps, times, lat)

    def all_to_all(self, cat: str, group: str, g: int, msg: float, times: int,
                   lat: int) -> None:
        """Each rank sends ``msg`` bytes to each of the ``g - 1`` others (``world``
        or ``replica`` group, as :meth:`ring`)."""
        if g <= 1 or msg == 0:
            return
        n = self.c.ranks_per_node
        if group == "world":
            # a node's N ranks each send to the g - N ranks of the other nodes
            nic, intra = n * (g - n) * msg, (min(n, g) - 1) * msg
        else:  # replica: every rank's g - 1 messages leave the node
            nic, intra = n * (g - 1) * msg, 0.0
        self._account(cat, (g - 1) * msg, (g - 1) * msg, self._crosses(group), intra, nic,
                      g - 1, times, lat)


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
            st.ring("gather", group, g, "all_gather", msg, calls, calls * cnt)
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
    if t.mode == "dense":
        st.all_to_all("grad", "world", g, s * eb, 1, cnt)
    elif t.mode == "quant":
        fmt = t.quant_format
        st.all_to_all("grad", "world", g, quant_bytes(s, fmt, t.quant_block), 1, cnt)
        # the own shard stays exact: g - 1 shards encoded, g - 1 messages decoded
        p.codec_s += (g - 1) * s * (1 / rates[f"quant_encode_{fmt}"]
                                    + 1 / rates[f"quant_decode_{fmt}"])
    else:  # every shard selected (the own one too), g messages added at the owner
        st.all_to_all("grad", "world", g, _pairs_msg(t, s, eb), 1, cnt)
        p.codec_s += _pairs_codec(t, s, g, g, rates)


def _cross(st: _Step, p: Prediction, t: Compression, cross: str, r: int, s: int, eb: int,
           cnt: int, rates: Dict[str, float]) -> None:
    """TAGC's HSDP exchange of one rank's shard of one unit between ``r`` replicas."""
    if t.vote_bytes:
        st.ring("control", "replica", r, "all_reduce", t.vote_bytes, cnt, cnt)
    if t.mode == "dense":  # tagc/hsdp.py _dense: dist.all_reduce
        st.ring("cross", "replica", r, "all_reduce", s * eb, 1, cnt)
    elif t.mode == "quant":
        fmt, blk = t.quant_format, t.quant_block
        enc, dec = rates[f"quant_encode_{fmt}"], rates[f"quant_decode_{fmt}"]
        if cross == "all-gather":  # tagc/hsdp.py _quant: every replica decodes all r
            st.ring("cross", "replica", r, "all_gather", quant_bytes(s, fmt, blk), 1, cnt)
            p.codec_s += s / enc + r * s / dec
        else:
            # two-phase (modelled, not implemented): r chunks of s/r; r - 1 of them go
            # compressed to their owners (all-to-all), each owner sums, re-encodes its
            # chunk and all-gathers it, and every replica decodes all r chunks
            chunk = -(-s // r)
            msg = quant_bytes(chunk, fmt, blk)
            st.all_to_all("cross", "replica", r, msg, 1, cnt)
            st.ring("cross", "replica", r, "all_gather", msg, 1, cnt)
            p.codec_s += (s + chunk) / enc + (2 * r - 1) * chunk / dec
    else:  # tagc/hsdp.py _pairs: the k pairs all-gathered, all r added
        st.ring("cross", "replica", r, "all_gather", _pairs_msg(t, s, eb), 1, cnt)
        p.codec_s += _pairs_codec(t, s, 1, r, rates)
