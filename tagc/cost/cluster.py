"""What TAGC would give on a user's cluster: step time, inter-node bytes and memory per
GPU for a few model sizes, FSDP2 FULL_SHARD across nodes and HSDP, plain bf16 FSDP
against TAGC presets (``docs/CLUSTER.md``).

The step time and the bytes are :func:`.predict.predict`'s, on a layout of the model as
``tagc.shard_model`` wraps it (every linear and embedding its own FSDP unit, the
presets' selection).  The TAGC configurations are built from the shipped presets as
they are when this runs (``TAGCConfig.preset``), so a preset's change moves the table.
Memory per GPU adds four estimates and one library figure:

* the sharded training state (``state_bytes`` per parameter, over every GPU for
  FULL_SHARD, over a node's GPUs for HSDP);
* activations from tokens per GPU, layers and width (Korthikanti et al. 2022);
* the unsharded unit buffers FSDP holds during its all-gathers (per-block units);
* TAGC's feedback state: :func:`feedback_bytes` per compressed unit, from the
  library's own layout of what its reducers keep (:mod:`tagc.memory`);
* TAGC's transient working copy of one unit (an estimate).

Every input the model cannot measure on this machine (GPU throughput and MFU, NCCL's
efficiency, overlap, the codec's GPU speed) is an :class:`Assumptions` field, printed
beside the table with its source.  Of these only the codec's speed has been measured on
a GPU (one H200, docs/gpu); nothing here has run NCCL between ranks.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Sequence

from tagc import memory
from tagc.hsdp import allreduce_form
from tagc.config import TAGCConfig

from .configs import HSDP_ALLREDUCE, Compression, Config, VALUE_DTYPES
from .layouts import ModelSpec, Unit, gpt2_model
from .links import Cluster, codec_rates
from .predict import Prediction, flops_compute_s, predict

log = logging.getLogger(__name__)

GIB = 2 ** 30

# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Shape:
    """A transformer's shape, enough for its FSDP units, compute and activations.

    Args:
        key: the ``--models`` name.
        label: what it is like (for reports).
        arch: ``gpt2`` (biases, GeLU MLP of ``ffn``, tied head, learned positions) or
            ``llama`` (no biases, SwiGLU MLP of ``ffn``, untied head, grouped KV heads).
        n_layer: transformer blocks.
        d_model: width.
        n_head: attention heads.
        n_kv_head: key/value heads (GQA; = n_head without it).
        ffn: MLP hidden width.
        vocab: vocabulary.
        context: positions (GPT-2's learned position embedding).
    """

    key: str
    label: str
    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    ffn: int
    vocab: int
    context: int

    def __post_init__(self) -> None:
        if self.arch not in ("gpt2", "llama"):
            raise ValueError(f"{self.key}: arch must be gpt2 or llama, got {self.arch!r}")
        for k in ("n_layer", "d_model", "n_head", "n_kv_head", "ffn", "vocab", "context"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{self.key}: {k} must be a positive int, got {v!r}")
        if self.d_model % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"{self.key}: d_model % n_head and n_head % n_kv_head must be 0")

    @property
    def kv_dim(self) -> int:
        """Width of the key and value projections (GQA: fewer heads)."""
        return self.d_model // self.n_head * self.n_kv_head

    def block_params(self) -> int:
        """Parameters of one transformer block (the FSDP unit of the usual per-block
        wrapping; GPT-2: 12 d^2 + 13 d, Llama: 2 d^2 + 2 d kv + 3 d ffn + 2 d)."""
        d, f = self.d_model, self.ffn
        if self.arch == "gpt2":
            return 4 * d * d + 2 * d * f + 9 * d + f  # attn 4d^2+4d, mlp 2df+d+f, 2 LN
        return 2 * d * d + 2 * d * self.kv_dim + 3 * d * f + 2 * d

    def outer_params(self) -> int:
        """Parameters outside the blocks: embeddings, head (Llama's is untied), the
        final norm."""
        d = self.d_model
        if self.arch == "gpt2":
            return self.vocab * d + self.context * d + 2 * d
        return 2 * self.vocab * d + d

    @property
    def params(self) -> int:
        """All parameters."""
        return self.n_layer * self.block_params() + self.outer_params()

    def act_bytes_per_token_layer(self) -> int:
        """Activation bytes one block keeps for backward per token (bf16), after
        Korthikanti et al. 2022 (arXiv 2205.05198, section 4.1: ``sbh(34 + 5as/h)``
        without tensor or sequence parallelism): attention and the two norms 15 d, the
        ``5as/h`` score terms dropped (flash attention keeps no s x s matrix), the MLP
        from its width: GeLU 3 d + 4 ffn (19 d at ffn = 4 d), SwiGLU's four ffn-wide
        tensors 2 d + 8 ffn."""
        d, f = self.d_model, self.ffn
        return 15 * d + (3 * d + 4 * f if self.arch == "gpt2" else 2 * d + 8 * f)

    def layout(self, layers: str, min_numel: int) -> ModelSpec:
        """The model as ``tagc.shard_model`` wraps it under a selection policy.

        Args:
            layers: ``all`` or ``non_attention`` (a preset's ``layers``).
            min_numel: the preset's smallest compressed parameter.
        Returns:
            the FSDP units.
        """
        name = f"{self.key} ({self.label})"
        if self.arch == "gpt2":
            return gpt2_model(self.n_layer, self.d_model, self.vocab, self.context,
                              layers=layers, min_numel=min_numel, name=name)
        return _llama_layout(self, layers, min_numel, name)


def _llama_layout(s: Shape, layers: str, min_numel: int, name: str) -> ModelSpec:
    """A Llama under TAGC's wrapping (``tagc/selection.py`` ``modules_to_wrap``): every
    linear and the embedding its own unit (each is above ``min_numel``; q/k/v always
    are), the norms in the root.  A unit is compressed when its one weight is selected:
    ``all`` selects every weight of at least ``min_numel`` elements, ``non_attention``
    all but q/k/v (as :func:`.layouts.gpt2_model` does for GPT-2)."""
    if layers not in ("all", "non_attention"):
        raise ValueError(f"layers must be 'all' or 'non_attention', got {layers!r}")
    d, kv, f = s.d_model, s.kv_dim, s.ffn

    def unit(nm: str, rows: int, cols: int, qkv: bool = False) -> Unit:
        big = rows * cols >= min_numel
        return Unit(nm, ((rows, cols),), big and not (qkv and layers == "non_attention"))

    units = [unit("embed_tokens", s.vocab, d)]
    for i in range(s.n_layer):
        units += [unit(f"l{i}.q_proj", d, d, True), unit(f"l{i}.k_proj", kv, d, True),
                  unit(f"l{i}.v_proj", kv, d, True), unit(f"l{i}.o_proj", d, d),
                  unit(f"l{i}.gate_proj", f, d), unit(f"l{i}.up_proj", f, d),
                  unit(f"l{i}.down_proj", d, f)]
    units.append(unit("lm_head", s.vocab, d))
    root = Unit("root", ((d, 1),) * (2 * s.n_layer + 1), False, root=True)  # the norms
    return ModelSpec(name, (root, *units))


# The models of the table: GPT-2 124M (Radford et al. 2019), a GPT-2 of GPT-3 XL's
# shape for 1.3B (Brown et al. 2020, table 2.1: 24 x 2048), Llama-2-7B and -70B
# (Touvron et al. 2023; the Hugging Face configs' shapes).
MODEL_SHAPES: Dict[str, Shape] = {s.key: s for s in (
    Shape("124m", "GPT-2 124M", "gpt2", 12, 768, 12, 12, 3072, 50257, 1024),
    Shape("1.3b", "GPT-2 arch., GPT-3 XL shape", "gpt2", 24, 2048, 16, 16, 8192, 50257, 2048),
    Shape("7b", "Llama-2-7B shape", "llama", 32, 4096, 32, 32, 11008, 32000, 4096),
    Shape("70b", "Llama-2-70B shape, GQA 8 KV heads", "llama", 80, 8192, 64, 8, 28672, 32000,
          4096),
)}


def shape(key: str) -> Shape:
    """A model of :data:`MODEL_SHAPES` by its name.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return MODEL_SHAPES[key.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown model {key!r}; known: {', '.join(MODEL_SHAPES)}") from None


# --------------------------------------------------------------------------- assumptions


@dataclass(frozen=True)
class Assumptions:
    """What the table cannot measure here: each figure with where it comes from.

    Args:
        tflops: peak dense bf16 TFLOP/s of one GPU.
        tflops_source: where ``tflops`` comes from.
        mfu: model FLOPs utilisation, in (0, 1].
        mfu_source: where ``mfu`` comes from.
        nccl_efficiency: fraction of the link bandwidth collectives reach, (0, 1].
        codec_speedup: the codec's GPU throughput over this CPU core's measured one.
        overlap: fraction of compute that hides communication, [0, 1].
        state_bytes: bytes of sharded training state per parameter.
        act_ckpt: activation checkpointing, ``full`` (every block) or ``none``.
        headroom: fraction of GPU memory kept for the CUDA context, NCCL and the
            allocator's fragmentation, [0, 1).
        intra_latency_us: per message inside a node.
        inter_latency_us: per message between nodes.
    """

    tflops: float = 312.0
    tflops_source: str = "A100 SXM dense bf16 peak (NVIDIA datasheet); pass your GPU's"
    mfu: float = 0.4
    mfu_source: str = "typical reported FSDP bf16 MFU; pass your own"
    nccl_efficiency: float = 0.8
    # docs/gpu/README.md, its second report (H200): tagc-balanced's int4 encode with
    # feedback and its decode took 5.59 ms for GPT-2 124M's 50 units, 22.3e9 values/s,
    # against 0.80e9 on this CPU core (links.DEFAULT_CODEC, encode + decode): 28x.  The
    # kernels alone at 2^24 values ran 61x (decode) to 149x (encode); launches per unit
    # make up the rest at 124M.
    codec_speedup: float = 28.0
    overlap: float = 1.0
    state_bytes: float = 16.0
    act_ckpt: str = "full"
    headroom: float = 0.10
    intra_latency_us: float = 5.0
    inter_latency_us: float = 30.0

    def __post_init__(self) -> None:
        checks = (("tflops", self.tflops > 0), ("mfu", 0 < self.mfu <= 1),
                  ("nccl_efficiency", 0 < self.nccl_efficiency <= 1),
                  ("codec_speedup", self.codec_speedup > 0), ("overlap", 0 <= self.overlap <= 1),
                  ("state_bytes", self.state_bytes > 0), ("headroom", 0 <= self.headroom < 1),
                  ("intra_latency_us", self.intra_latency_us >= 0),
                  ("inter_latency_us", self.inter_latency_us >= 0))
        for k, ok in checks:
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and ok):
                raise ValueError(f"{k}: out of range, got {v!r}")
        if self.act_ckpt not in ("full", "none"):
            raise ValueError(f"act_ckpt must be 'full' or 'none', got {self.act_ckpt!r}")

    def lines(self) -> List[str]:
        """The assumptions as printed beside the table, one per line."""
        ckpt = ("every block checkpointed: its input kept (2 d bytes per token and block), "
                "one block's activations live during its recompute" if self.act_ckpt == "full"
                else "no activation checkpointing: every block's activations kept")
        return [
            f"GPU compute: {self.tflops:g} TFLOP/s peak ({self.tflops_source}) x MFU "
            f"{self.mfu:g} ({self.mfu_source}); compute per step = 6 x params x tokens per "
            "GPU / (peak x MFU) (Kaplan et al. 2020; attention FLOPs and recompute inside "
            "the MFU)",
            f"NCCL efficiency {self.nccl_efficiency:g}: fraction of each link's bandwidth a "
            "collective reaches (assumption; not measured, nothing here ran NCCL)",
            f"latency per message: {self.intra_latency_us:g} us inside a node, "
            f"{self.inter_latency_us:g} us between nodes (assumption)",
            f"overlap {self.overlap:g}: that fraction of compute hides communication (FSDP2 "
            "prefetches its all-gathers and reduce-scatters on their own streams; TAGC's "
            "collectives assumed to overlap alike, its codec not at all; on this project's "
            "CPU runs nothing overlapped)",
            f"TAGC codec on the GPU: {self.codec_speedup:g}x this CPU core's measured "
            "throughput (28x measured on an H200: int4 encode with feedback and decode of "
            "GPT-2 124M's 50 units in 5.59 ms a step, docs/gpu/README.md (its second report); "
            "the kernels alone at 2^24 values ran 61-149x; another GPU: pass your own)",
            f"training state: {self.state_bytes:g} bytes per parameter, sharded (bf16 "
            "mixed precision with fp32 master weights and AdamW: FSDP2 keeps the sharded "
            "parameter and its gradient in fp32 (8) plus two fp32 moments (8); the ZeRO "
            "paper's 2 + 2 + 12 is the same 16)",
            f"activations: bf16, Korthikanti et al. 2022 (arXiv 2205.05198) per block and "
            "token 34 d for GPT-2 (15 d + 2 d + 8 ffn for SwiGLU), flash attention (no "
            f"s x s scores); {ckpt}; plus 6 bytes per token and vocabulary entry for the "
            "logits (bf16, and an fp32 copy for the loss)",
            "FSDP unit buffers: per-block units (the usual FSDP2 wrapping), bf16: two "
            "blocks' parameters (the current one and the prefetched next) and one block's "
            "gradient, plus the root (embeddings, head, norms) and its gradient, which "
            "FSDP2 keeps unsharded through the step; TAGC's own wrapping (a unit per "
            "linear) holds less",
            "TAGC feedback: tagc.cost.cluster.feedback_bytes(preset, unit, ...) summed over the "
            "compressed units of tagc.shard_model's layout, for the presets as shipped now, "
            "and with local steps (outer_every) tagc.memory.outer_bytes (two fp32 shards) "
            "over every unit; plus one fp32 working copy of the largest compressed unit "
            "during a call (estimate)",
            f"fits: total <= (1 - {self.headroom:g}) x GPU memory ({self.headroom:g} kept for "
            "the CUDA context, NCCL buffers and fragmentation: assumption); GB = GiB",
        ]


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU of one cell.

    Attributes:
        state: sharded parameters, gradients and optimizer state.
        activations: what the forward keeps for backward, logits included.
        buffers: FSDP's unsharded unit parameters and gradients.
        feedback: TAGC's persistent feedback state (``tagc.memory``).
        transient: TAGC's working copy of one unit during a call.
        limit: usable bytes (the GPU's, less the headroom).
    """

    state: float
    activations: float
    buffers: float
    feedback: float
    transient: float
    limit: float

    @property
    def total(self) -> float:
        """Bytes per GPU."""
        return self.state + self.activations + self.buffers + self.feedback + self.transient

    @property
    def fits(self) -> bool:
        """Whether the total is within the usable memory."""
        return self.total <= self.limit


def activation_bytes(s: Shape, tokens: int, act_ckpt: str) -> float:
    """Activation bytes per GPU (see :meth:`Shape.act_bytes_per_token_layer`).

    Args:
        s: the model.
        tokens: tokens per GPU per step.
        act_ckpt: ``full`` or ``none``.
    Returns:
        bytes.
    """
    layer = s.act_bytes_per_token_layer() * tokens
    logits = 6 * tokens * s.vocab
    if act_ckpt == "none":
        return s.n_layer * layer + logits
    return s.n_layer * 2 * s.d_model * tokens + layer + logits


def feedback_bytes(cfg: TAGCConfig, numel: int, world: int, replicas: int = 1) -> int:
    """Persistent bytes one rank holds for one compressed unit of ``numel`` parameters,
    before the model exists (this model's memory column; the reducers' own layout is
    :mod:`tagc.memory`).

    FULL_SHARD (``replicas`` 1): the unit is reduced over ``world`` ranks.  TAGC's
    HSDP (``replicas`` R > 1): the unit is sharded over ``world`` ranks of a node, and
    each shard all-reduced over R replicas in the form
    :func:`tagc.hsdp.allreduce_form` picks.

    Args:
        cfg: the config.
        numel: the unit's parameters.
        world: ranks the unit is sharded over.
        replicas: R (1: no HSDP).
    Returns:
        bytes.
    """
    if not cfg.compresses or not cfg.feeds_back:
        return 0
    shard = math.ceil(numel / world)
    if replicas <= 1:
        return memory.buffer_bytes(memory.unit_buffers(cfg, shard * world, shard))
    if allreduce_form(cfg, replicas, True, shard) == "gather":
        return memory.buffer_bytes(memory.unit_buffers(cfg, shard, shard))
    chunk = math.ceil(shard / replicas)
    return memory.buffer_bytes(memory.unit_buffers(cfg, chunk * replicas, chunk)
                               + memory.out_buffers(cfg, chunk, replicas))


def feedback_state(cfg: TAGCConfig, model: ModelSpec, world: int, replicas: int) -> int:
    """TAGC's persistent bytes per GPU: :func:`feedback_bytes` summed over the
    compressed units, with local steps ``tagc.memory.outer_bytes`` over every unit, and
    with ``gather_delta`` the gathered weights every rank keeps.

    Args:
        cfg: the preset.
        model: the layout under the preset's selection.
        world: GPUs a unit is sharded over (FULL_SHARD: all; HSDP: a node's).
        replicas: HSDP's replicas R (1: FULL_SHARD).
    Returns:
        bytes.
    """
    held = 0
    if cfg.gather_delta:
        # every rank keeps each unit's gathered weights (bf16, the table's parameter
        # dtype) and its own shard between calls: tagc/gather.py
        held = sum(2 * (world + 1) * math.ceil(u.numel / world) for u in model.units)
    return held + sum(feedback_bytes(cfg, u.numel, world, replicas)
                      for u in model.units if u.compressed) + \
        sum(memory.outer_bytes(cfg, u.numel, world, replicas) for u in model.units)


def memory_per_gpu(s: Shape, model: ModelSpec, hsdp: bool, nodes: int, gpus_per_node: int,
                   gpu_mem_gb: float, tokens: int, a: Assumptions,
                   cfg: Optional[TAGCConfig] = None) -> Memory:
    """Memory per GPU of one cell.

    Args:
        s: the model's shape.
        model: its layout (under ``cfg``'s selection when ``cfg`` is given).
        hsdp: HSDP (sharded over a node's GPUs) or FULL_SHARD (over every GPU).
        nodes: nodes R.
        gpus_per_node: N.
        gpu_mem_gb: GiB per GPU.
        tokens: tokens per GPU per step.
        a: the assumptions.
        cfg: the TAGC preset, None for plain FSDP.
    Returns:
        the breakdown.
    """
    world = gpus_per_node if hsdp else gpus_per_node * nodes
    state = a.state_bytes * math.ceil(s.params / world)
    block = s.block_params()
    buffers = 2 * (3 * block + 2 * s.outer_params())
    feedback = transient = 0.0
    # TAGC's HSDP route compresses only the all-reduce between replicas (inside a node
    # FSDP's own reduce-scatter runs, as predict models it): at R = 1 it holds nothing
    if cfg is not None and not (hsdp and nodes == 1):
        feedback = feedback_state(cfg, model, world, nodes if hsdp else 1)
        largest = max((u.numel for u in model.units if u.compressed), default=0)
        transient = 4.0 * largest
    return Memory(state, activation_bytes(s, tokens, a.act_ckpt), buffers, feedback, transient,
                  (1 - a.headroom) * gpu_mem_gb * GIB)


# --------------------------------------------------------------------------- configurations


PLAIN = "plain bf16"


def compression_of(cfg: TAGCConfig) -> Compression:
    """The cost model's compression of a preset, from its fields as loaded now.

    Args:
        cfg: the preset.
    Returns:
        the compression (its wire sizes are the library's rules, :mod:`.configs`).
    Raises:
        ValueError: a mode whose bytes depend on the data (``exact``, ``paper``).
    """
    value_bytes = next(b for b, d in VALUE_DTYPES.items() if d == cfg.value_dtype)
    return Compression(cfg.mode, cfg.quant_format, cfg.quant_block, cfg.theta, value_bytes,
                       bool(cfg.ef21), cfg.gather, cfg.gather_block, cfg.hsdp_out_format,
                       cfg.residual_code if cfg.feeds_back else "none", cfg.outer_every,
                       bool(cfg.gather_delta))


def configuration(name: str, hsdp: bool, cfg: Optional[TAGCConfig]) -> Config:
    """A cell's configuration: bf16 on the wire, FSDP2, TAGC's HSDP form as the preset
    says (``hsdp_allreduce``, default ``auto``).

    Args:
        name: for reports.
        hsdp: HSDP or FULL_SHARD.
        cfg: the preset, or None for plain bf16 FSDP.
    Returns:
        the configuration.
    """
    if cfg is None:
        return Config(name, "hsdp" if hsdp else "full_shard", None, "auto", "bf16", 2)
    cross = {v: k for k, v in HSDP_ALLREDUCE.items()}[cfg.hsdp_allreduce] if hsdp else "auto"
    return Config(name, "hsdp" if hsdp else "full_shard", compression_of(cfg), cross, "bf16", 2)


# --------------------------------------------------------------------------- cells


@dataclass(frozen=True)
class Hardware:
    """The user's cluster.

    Args:
        gpus_per_node: N.
        gpu_mem_gb: GiB per GPU.
        nic_gbit: a node's bandwidth to the other nodes, Gbit/s.
        intra_gbit: a GPU's bandwidth to the others of its node (NVLink), Gbit/s.
    """

    gpus_per_node: int
    gpu_mem_gb: float
    nic_gbit: float
    intra_gbit: float

    def __post_init__(self) -> None:
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) \
                or self.gpus_per_node < 1:
            raise ValueError(f"GPUs per node must be an int >= 1, got {self.gpus_per_node!r}")
        for k, unit in (("gpu_mem_gb", "GB"), ("nic_gbit", "Gbit/s"), ("intra_gbit", "Gbit/s")):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{k} must be a positive number of {unit}, got {v!r}")

    def cluster(self, nodes: int, a: Assumptions) -> Cluster:
        """The cost model's cluster at ``nodes`` nodes."""
        return Cluster(self.gpus_per_node, nodes, self.intra_gbit, self.nic_gbit,
                       a.intra_latency_us * 1e-6, a.inter_latency_us * 1e-6, "nccl", a.overlap,
                       a.nccl_efficiency)


@dataclass
class Cell:
    """One model x nodes x layout x configuration.

    Attributes:
        model: the shape's key.
        nic_gbit: the inter-node bandwidth.
        nodes: R.
        gpus: every GPU, N x R.
        layout: ``FULL_SHARD`` or ``HSDP``.
        config: ``plain bf16`` or a preset name.
        pred: the cost model's prediction.
        mem: memory per GPU.
        inter_s: communication time with the intra-node link free (the inter-node
            link's share).
        intra_s: communication time with the inter-node link free.
        baseline_s: plain bf16's step time on the same layout and nodes.
    """

    model: str
    nic_gbit: float
    nodes: int
    gpus: int
    layout: str
    config: str
    pred: Prediction
    mem: Memory
    inter_s: float
    intra_s: float
    baseline_s: float = 0.0

    @property
    def step_s(self) -> float:
        """Predicted step time."""
        return self.pred.step_s

    @property
    def speedup(self) -> float:
        """Plain bf16's step time over this cell's."""
        return self.baseline_s / self.step_s

    @property
    def inter_bytes_per_gpu(self) -> float:
        """Bytes per GPU per step on the inter-node link (a node's over its GPUs)."""
        return self.pred.node_inter / (self.gpus // self.nodes)

    def terms(self) -> Dict[str, float]:
        """The times that can bound the step."""
        return {"compute": self.pred.compute_s, "inter-node link": self.inter_s,
                "intra-node link": self.intra_s, "codec": self.pred.codec_s}

    @property
    def bound(self) -> str:
        """The largest term."""
        t = self.terms()
        return max(t, key=t.get)  # type: ignore[arg-type]

    def row(self) -> Dict[str, Any]:
        """The cell as a flat dict (``--json``)."""
        m = self.mem
        return {"model": self.model, "nic_gbit": self.nic_gbit, "nodes": self.nodes,
                "gpus": self.gpus, "layout": self.layout, "config": self.config,
                "step_s": self.step_s, "speedup": self.speedup,
                "inter_node_mb_per_gpu": self.inter_bytes_per_gpu / 1e6,
                "compute_s": self.pred.compute_s, "comm_s": self.pred.comm_s,
                "inter_link_s": self.inter_s, "intra_link_s": self.intra_s,
                "codec_s": self.pred.codec_s, "bound": self.bound,
                "memory_gib": {"state": m.state / GIB, "activations": m.activations / GIB,
                               "buffers": m.buffers / GIB, "feedback": m.feedback / GIB,
                               "transient": m.transient / GIB, "total": m.total / GIB,
                               "limit": m.limit / GIB},
                "fits": m.fits}


# a bandwidth standing for "free": the other link's time then is all there is
_FREE_GBIT = 1e9


def _cell(s: Shape, model: ModelSpec, hw: Hardware, nodes: int, hsdp: bool, name: str,
          cfg: Optional[TAGCConfig], tokens: int, a: Assumptions,
          codec: Dict[str, float]) -> Cell:
    """Predict one cell (and, for the bound, its communication with either link free)."""
    conf = configuration(name, hsdp, cfg)
    c = hw.cluster(nodes, a)
    compute = flops_compute_s(s.params, tokens, a.tflops, a.mfu)
    pred = predict(model, c, conf, compute, codec)
    inter = predict(model, replace(c, intra_gbit=_FREE_GBIT, intra_latency_s=0.0), conf, 0.0,
                    codec).comm_s
    intra = predict(model, replace(c, inter_gbit=_FREE_GBIT, inter_latency_s=0.0), conf, 0.0,
                    codec).comm_s
    mem = memory_per_gpu(s, model, hsdp, nodes, hw.gpus_per_node, hw.gpu_mem_gb, tokens, a, cfg)
    return Cell(s.key, hw.nic_gbit, nodes, c.world, "HSDP" if hsdp else "FULL_SHARD", name,
                pred, mem, inter, intra)


def cells(models: Sequence[str], hw: Hardware, nodes: Sequence[int], tokens: int,
          presets: Sequence[str], a: Assumptions) -> List[Cell]:
    """Every model x node count x layout x configuration on one cluster.

    Args:
        models: keys of :data:`MODEL_SHAPES`.
        hw: the cluster.
        nodes: node counts.
        tokens: tokens per GPU per step.
        presets: TAGC presets (``TAGCConfig.preset`` names), compared with plain bf16.
        a: the assumptions.
    Returns:
        the cells, plain bf16 first in each group, each with its baseline set.
    """
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens per GPU must be an int >= 1, got {tokens!r}")
    if not nodes or any(not isinstance(r, int) or r < 1 for r in nodes):
        raise ValueError(f"node counts must be ints >= 1, got {list(nodes)!r}")
    shapes = [shape(m) for m in models]
    if not shapes:
        raise ValueError("no model given")
    cfgs = [(p, TAGCConfig.preset(p)) for p in presets]
    codec = codec_rates({}, a.codec_speedup)
    out: List[Cell] = []
    for s in shapes:
        # plain FSDP's bytes do not depend on the selection; each preset gets its own
        layouts = {(c.layers, c.min_numel): s.layout(c.layers, c.min_numel) for _, c in cfgs}
        plain_model = next(iter(layouts.values()), None) or s.layout("all", 65536)
        for r in nodes:
            for hsdp in (False, True):
                base = _cell(s, plain_model, hw, r, hsdp, PLAIN, None, tokens, a, codec)
                # local steps (outer_every) exist on the HSDP route only
                group = [base] + [_cell(s, layouts[(c.layers, c.min_numel)], hw, r, hsdp, p, c,
                                        tokens, a, codec) for p, c in cfgs
                                  if hsdp or not c.outer_every]
                for cell in group:
                    cell.baseline_s = base.step_s
                out += group
        log.debug("cluster table: %s done", s.key)
    return out


# --------------------------------------------------------------------------- report


def _gib(b: float) -> str:
    """Bytes as GiB, one decimal."""
    return f"{b / GIB:.1f}"


def _mb(b: float) -> str:
    """Bytes as MB: whole MB from 100 on, else 3 significant digits."""
    mb = b / 1e6
    return f"{mb:.0f}" if mb >= 100 else f"{mb:.3g}"


def model_lines(models: Sequence[str], presets: Sequence[str]) -> List[str]:
    """One line per model: its shape, parameters and FSDP units (TAGC's layout)."""
    out = []
    for m in models:
        s = shape(m)
        units = s.layout("all", TAGCConfig.preset(presets[0]).min_numel if presets else 65536)
        kv = f", {s.n_kv_head} KV heads" if s.n_kv_head != s.n_head else ""
        out.append(f"- {s.key}: {s.label}, {s.params / 1e9:.3g}B parameters, {s.n_layer} "
                   f"layers, width {s.d_model}, MLP {s.ffn}, {s.n_head} heads{kv}, vocabulary "
                   f"{s.vocab}; {s.block_params() / 1e6:.4g}M per block; "
                   f"{units.unit_count} FSDP units under tagc.shard_model")
    return out


def preset_lines(presets: Sequence[str]) -> List[str]:
    """One line per preset: what its feedback state costs per parameter of a unit, from
    ``tagc.memory`` (so the reader sees which presets' state the table used)."""
    out = []
    n = 2 ** 24
    for p in presets:
        cfg = TAGCConfig.preset(p)
        fs = feedback_bytes(cfg, n, 8) / n
        hs = feedback_bytes(cfg, n, 8, replicas=4) / n
        out.append(f"- {p}: mode {cfg.mode} {cfg.quant_format}, ef21 {cfg.ef21}, residual "
                   f"code {cfg.residual_code}, gathers {cfg.gather}; feedback per GPU and "
                   f"parameter of a unit at 8 GPUs: FULL_SHARD {fs:.3g} B, HSDP R=4 {hs:.3g} B")
    return out


def table(cs: Sequence[Cell]) -> str:
    """The cells as one markdown table (one row per cell).

    Args:
        cs: :func:`cells`' result.
    Returns:
        the text.
    """
    lines = ["| model | NIC Gbit/s | nodes | GPUs | layout | config | step s | vs plain bf16 "
             "| inter-node MB/GPU | memory GiB/GPU | fits | bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cs:
        lines.append(f"| {c.model} | {c.nic_gbit:g} | {c.nodes} | {c.gpus} | {c.layout} | "
                     f"{c.config} | {c.step_s:.4g} | {c.speedup:.2f}x | "
                     f"{_mb(c.inter_bytes_per_gpu)} | {_gib(c.mem.total)} | "
                     f"{'yes' if c.mem.fits else 'NO'} | {c.bound} |")
    return "\n".join(lines)


def explain(cs: Sequence[Cell]) -> str:
    """Per cell: the terms that make the step and which one bounds it, and the memory
    breakdown.

    Args:
        cs: :func:`cells`' result.
    Returns:
        the text.
    """
    lines = []
    for c in cs:
        p, m = c.pred, c.mem
        hidden = min(p.comm_s, p.overlap * p.compute_s)
        lines.append(
            f"- {c.model} | {c.nic_gbit:g} Gbit/s | R={c.nodes} | {c.layout} | {c.config}: "
            f"step {c.step_s:.4g} s bound by {c.bound} (compute {p.compute_s:.4g} s; "
            f"communication {p.comm_s:.4g} s, of it the inter-node link alone "
            f"{c.inter_s:.4g} s, the intra-node link alone {c.intra_s:.4g} s, "
            f"{hidden:.4g} s hidden behind compute; codec {p.codec_s:.4g} s); memory "
            f"{_gib(m.total)} of {_gib(m.limit)} GiB usable = state {_gib(m.state)} + "
            f"activations {_gib(m.activations)} + unit buffers {_gib(m.buffers)} + TAGC "
            f"feedback {_gib(m.feedback)} + TAGC working copy {_gib(m.transient)}"
            f"{'' if m.fits else ': does NOT fit'}")
    return "\n".join(lines)


def report(cs: Sequence[Cell], hws: Sequence[Hardware], models: Sequence[str],
           presets: Sequence[str], tokens: int, a: Assumptions, with_explain: bool) -> str:
    """The whole printout: inputs, assumptions, models, presets, the table, and
    optionally the per-cell explanation.

    Args:
        cs: the cells (of every cluster in ``hws``).
        hws: the clusters (one per NIC bandwidth).
        models: the models.
        presets: the presets.
        tokens: tokens per GPU per step.
        a: the assumptions.
        with_explain: add :func:`explain`.
    Returns:
        the text.
    """
    hw = hws[0]
    lines = ["# What TAGC would give on this cluster (cost-model predictions, not measurements)",
             "",
             f"inputs: {hw.gpus_per_node} GPUs per node, {hw.gpu_mem_gb:g} GiB each; between "
             f"nodes {', '.join(f'{h.nic_gbit:g}' for h in hws)} Gbit/s per node; inside a "
             f"node {hw.intra_gbit:g} Gbit/s per GPU; {tokens} tokens per GPU per step; "
             "FSDP2, bf16 parameters and gradients on the wire",
             "", "assumptions (not measured here; pass your own):", ""]
    lines += [f"- {x}" for x in a.lines()]
    lines += ["", "models:", ""] + model_lines(models, presets)
    lines += ["", "presets (as shipped when this ran):", ""] + preset_lines(presets)
    lines += ["", "layouts: FULL_SHARD = FSDP2 over every GPU of every node; HSDP = sharded "
              "inside a node, replicated across nodes (TAGC: its HSDP route, the preset's "
              "hsdp_allreduce form). vs plain bf16 = plain bf16's step time on the same layout "
              "and nodes over this one's. bound = the largest of compute, the inter-node "
              "link's communication, the intra-node link's, the codec.", "", table(cs)]
    if with_explain:
        lines += ["", "## Explain", ""] + [explain(cs)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def _list(kind: type, what: str):
    """argparse type: a comma-separated list of positive ``kind``."""
    def parse(text: str) -> list:
        try:
            out = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{what}: expected comma-separated numbers, "
                                             f"got {text!r}") from e
        if not out or any(not (math.isfinite(x) and x > 0) for x in out):
            raise argparse.ArgumentTypeError(f"{what} must be > 0, got {text!r}")
        return out
    return parse


def build_parser(prog: str = "python -m tagc.cost --cluster") -> argparse.ArgumentParser:
    """The ``python -m tagc.cost --cluster`` command line.

    Args:
        prog: the command's name in the usage line.
    Returns:
        the parser.
    """
    d = Assumptions()
    p = argparse.ArgumentParser(
        prog=prog,
        description="What TAGC would give on your cluster: step time, speed-up over plain "
                    "bf16 FSDP, inter-node bytes and memory per GPU (fits or not) for model "
                    "sizes x node counts x FULL_SHARD/HSDP x plain bf16/TAGC presets. Cost-model "
                    "predictions; every assumption is printed with the table (docs/CLUSTER.md).")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    c.add_argument("--gpu-mem-gb", type=float, default=80.0, help="GiB per GPU (default 80)")
    c.add_argument("--nic-gbit", type=_list(float, "--nic-gbit"), default=[100.0, 25.0],
                   help="a node's bandwidth to the other nodes, Gbit/s; a list gives a table "
                        "each (default 100,25)")
    c.add_argument("--intra-gbit", type=float, default=2400.0,
                   help="a GPU's bandwidth to its node's others, Gbit/s (default 2400: A100 "
                        "NVLink 3, 300 GB/s each way)")
    c.add_argument("--nodes", type=_list(int, "--nodes"), default=[1, 2, 4, 8, 16, 64, 128],
                   help="node counts (default 1,2,4,8,16,64,128)")
    w = p.add_argument_group("workload")
    w.add_argument("--tokens-per-gpu", type=int, default=8192,
                   help="tokens per GPU per step (default 8192)")
    w.add_argument("--models", default=",".join(MODEL_SHAPES),
                   help=f"comma-separated, of {', '.join(MODEL_SHAPES)} (default all)")
    w.add_argument("--presets", default="tagc-full,tagc-balanced",
                   help="TAGC presets against plain bf16 (default tagc-full,tagc-balanced)")
    w.add_argument("--act-ckpt", choices=("full", "none"), default=d.act_ckpt,
                   help=f"activation checkpointing (default {d.act_ckpt}: every block)")
    s = p.add_argument_group("assumptions (printed with the table)")
    s.add_argument("--tflops", type=float, default=d.tflops,
                   help=f"peak dense bf16 TFLOP/s per GPU (default {d.tflops:g}: A100)")
    s.add_argument("--tflops-source", default=None, help="where your --tflops comes from")
    s.add_argument("--mfu", type=float, default=d.mfu, help=f"model FLOPs utilisation (default "
                   f"{d.mfu:g}: typical reported FSDP bf16 MFU)")
    s.add_argument("--mfu-source", default=None, help="where your --mfu comes from")
    s.add_argument("--nccl-efficiency", type=float, default=d.nccl_efficiency,
                   help=f"fraction of link bandwidth collectives reach (default "
                        f"{d.nccl_efficiency:g})")
    s.add_argument("--codec-speedup", type=float, default=d.codec_speedup,
                   help=f"codec GPU throughput over this CPU core's (default {d.codec_speedup:g}; "
                        "measured on an H200, docs/gpu)")
    s.add_argument("--overlap", type=float, default=d.overlap,
                   help=f"fraction of compute hiding communication (default {d.overlap:g})")
    s.add_argument("--state-bytes", type=float, default=d.state_bytes,
                   help=f"sharded training state per parameter (default {d.state_bytes:g})")
    s.add_argument("--headroom", type=float, default=d.headroom,
                   help=f"fraction of GPU memory not usable (default {d.headroom:g})")
    s.add_argument("--inter-latency-us", type=float, default=d.inter_latency_us)
    s.add_argument("--intra-latency-us", type=float, default=d.intra_latency_us)
    o = p.add_argument_group("output")
    o.add_argument("--explain", action="store_true",
                   help="per cell: which term bounds the step, and the memory breakdown")
    o.add_argument("--json", action="store_true", help="the cells as JSON instead of the table")
    return p


def run(argv: Optional[List[str]] = None, prog: str = "python -m tagc.cost --cluster") -> str:
    """Parse ``python -m tagc.cost --cluster``'s arguments and build its printout.

    Args:
        argv: the arguments after ``--cluster``.
        prog: the command's name in the usage line.
    Returns:
        the text to print (the table, or JSON with ``--json``).
    Raises:
        SystemExit: bad input (argparse's message on stderr, exit code 2).
    """
    p = build_parser(prog)
    args = p.parse_args(argv)
    try:
        d = Assumptions()
        a = Assumptions(args.tflops, args.tflops_source or (d.tflops_source if args.tflops
                                                            == d.tflops else "given"),
                        args.mfu, args.mfu_source or (d.mfu_source if args.mfu == d.mfu
                                                      else "given"),
                        args.nccl_efficiency, args.codec_speedup, args.overlap,
                        args.state_bytes, args.act_ckpt, args.headroom,
                        args.intra_latency_us, args.inter_latency_us)
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        presets = [x.strip() for x in args.presets.split(",") if x.strip()]
        hws = [Hardware(args.gpus_per_node, args.gpu_mem_gb, nic, args.intra_gbit)
               for nic in args.nic_gbit]
        cs: List[Cell] = []
        for hw in hws:
            cs += cells(models, hw, args.nodes, args.tokens_per_gpu, presets, a)
    except ValueError as e:
        p.error(str(e))
    if args.json:
        return json.dumps({"assumptions": asdict(a), "cells": [c.row() for c in cs]}, indent=1)
    return report(cs, hws, models, presets, args.tokens_per_gpu, a, args.explain)
