"""TAGC: Transformer-Aware Gradient Compression for stock PyTorch FSDP.

One call turns an FSDP model's gradient reduce-scatter into a compressed
exchange; no patch to torch and no per-step call::

    import tagc_hook as tagc
    cfg = tagc.TAGCConfig(mode="exact", theta=0.9875)
    state = tagc.register(model, cfg)   # FSDP1 root, or an FSDP2 model
    ...train as usual...
    state.stats()
    dcp.save({"model": ..., "optim": ..., "tagc": state}, checkpoint_id=path)  # or
    torch.save(state.state_dict(), f"tagc-rank{rank}.pt")

Design: ``DESIGN.md`` sections 2 (one hook call), 4 (transports), 5 (hooking
into FSDP), 6 (which units are compressed) and 7 (this API).  All codec work
(selection, sparsification, bitmaps, lanes, sketches, peeling, pair packing)
is done by the C module ``_tagc``; this file only moves buffers between ranks
and keeps per-unit state.

Decisions documented here (they are visible in behaviour):

* Granularity is the FSDP unit.  FSDP1 hands the hook a flat gradient whose
  shards cut across parameters, and FSDP2's comm sees the unit's rows
  (``input.view(N, -1)``, row ``r`` = chunk ``r`` of every parameter), so a
  unit is either compressed as a whole (shard ``s`` = row ``s``) or not at
  all.  A unit is compressed when the parameters selected by ``cfg.layers``
  hold at least half of its elements.  :func:`fsdp1_auto_wrap_policy` and
  :func:`shard_model` give every selected module (and every big unselected
  ``nn.Linear``/``nn.Embedding``, e.g. the attention QKV projection) its own
  unit so the rule is exact for them; only a selected module's bias rides
  along with its weight.
* Error feedback residuals live in "sum space": the residual of rank ``i`` is
  what rank ``i`` did not send of its own un-averaged gradient, so
  ``divisor * sum(outputs over owners) + sum(residuals over ranks)`` equals
  the sum of the raw gradients over ranks and steps.
* Non-finite gradients: before compressing, ranks agree (one 4-byte
  all-reduce per compressed call) whether any rank's unit gradient holds
  NaN/Inf; if so every rank takes the plain reduce-scatter that call and the
  residual is left untouched, so GradScaler sees the inf/nan.  On CUDA the
  flag never reaches the host: every rank instead poisons every shard with a
  NaN (:func:`_poison_nonfinite`), which the CUDA sparsify answers by leaving
  the residual untouched and sending NaN to every owner.
* CUDA: codec work runs on a side stream per device, ordered against FSDP's
  reduce-scatter stream, with no host synchronisation (timeline in
  ``TAGCState._run``); counters accumulate on the device and are read by
  ``stats()``; exact mode has no recovery exchange there (unpeeled entries get
  the median estimate and are counted).
* NO_SHARD with more than one rank, HYBRID_SHARD (FSDP1) and HSDP meshes
  (FSDP2) are refused: the first is DDP (use DDP comm hooks), the others
  reduce over two groups.
* With one rank nothing is compressed: FSDP2 never calls the comm and FSDP1
  switches itself to NO_SHARD, whose reduction the hook leaves as the identity.
* Warm-up (``dense_steps``, ``warmup_steps``): a unit's reduction number
  ``step`` decides plain vs compressed and the sparsity; it is the same on
  every rank (and checkpointed), so the ranks switch together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

try:  # the codec; `dense` mode and config handling work without it
    import _tagc
except ImportError as _exc:  # pragma: no cover - exercised only without a build
    _tagc = None
    _TAGC_IMPORT_ERROR: Optional[BaseException] = _exc
else:
    _TAGC_IMPORT_ERROR = None

logger = logging.getLogger(__name__)

__all__ = [
    "TAGCConfig",
    "TAGCState",
    "register",
    "fsdp1_auto_wrap_policy",
    "shard_model",
    "select_parameter",
    "MODES",
    "QUANT_FORMATS",
    "PAPER_THETA",
]

MODES = ("paper", "exact", "sparse", "quant", "dense")
QUANT_FORMATS = ("sign", "ternary", "int4", "int8")
# Bits on the wire per value of each quant format (scales excluded).
QUANT_BITS = {"sign": 1.0, "ternary": 1.6, "int4": 4.0, "int8": 8.0}
# The paper's compression presets: ratio -> sparsity (Table/Section 4 of the paper).
PAPER_THETA: Dict[float, float] = {2.0: 0.80, 4.0: 0.90, 10.0: 0.9875}
_FLOAT_DTYPES = {"float32": torch.float32, "fp32": torch.float32,
                 "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# Module names that always denote a fused or split attention QKV projection.
_QKV_ALWAYS = {"c_attn", "qkv", "qkv_proj", "query_key_value", "wqkv", "in_proj", "to_qkv"}
# Names that denote Q/K/V only below an attention module ("q" alone is too generic).
_QKV_IN_ATTN = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
                "q", "k", "v", "to_q", "to_k", "to_v", "q_lin", "k_lin", "v_lin"}
# Wrapper components FSDP1 / checkpointing / torch.compile insert into module names.
_WRAPPER_NAMES = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}

LayerPolicy = Union[str, Callable[[str, nn.Module, str, nn.Parameter], bool]]


def _require_codec() -> None:
    if _tagc is None:
        raise ImportError(
            "the TAGC codec module `_tagc` is not built; run `pip install -e .` in the "
            f"repository (import failed with: {_TAGC_IMPORT_ERROR})")


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


# --------------------------------------------------------------------------- config

@dataclass
class TAGCConfig:
    """Every knob of TAGC, validated on construction.

    Args:
        mode: transport (DESIGN.md section 4). ``"paper"``: the paper's
            Algorithm 1, index all-reduce SUM on ``index_bits`` lanes plus a
            fixed ``S/ratio`` sketch per shard reduced to its owner (1-bit
            lanes lose entries to carries; reported in stats). ``"exact"``:
            bitmap all-to-all with a true OR at the owner, sketch sized from
            the union bound, lossless (a recovery exchange resolves entries
            peeling leaves). ``"sparse"``: exactly ``k`` (offset, value) pairs
            per shard in one all-to-all. ``"quant"``: every entry of a shard,
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
            ``torch.float32`` or ``torch.bfloat16``.
        layers: which parameters are compressed: ``"non_attention"``
            (``nn.Linear``/``nn.Embedding`` weights that are not attention
            QKV projections, see :func:`select_parameter`), ``"all"`` (every
            parameter with >= ``min_numel`` elements), or a callable
            ``(module_name, module, param_name, param) -> bool``.
        min_numel: smallest parameter compressed by the built-in policies.
        error_feedback: keep per-rank, per-unit residuals of what was not sent
            and add them back next step.
        seed: base of the sketch hash seeds, ``_tagc.seed_derive(seed, unit, step)``.
        residual_dtype: residual storage, ``torch.float32`` (default) or
            ``torch.bfloat16`` (halves the memory, rounds the feedback).
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
        warmup_steps: after the dense steps, ``exact`` and ``sparse`` ramp the
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
            ``s = min(2.5 mean|v|, max|v|)``, 1.6 bits) or ``"sign"``
            (+-mean|v|, 1 bit).  Why it works where top-k struggles: every
            coordinate reaches the optimizer every step, so AdamW's
            per-coordinate moments see a stream like plain training, not
            bursts every 1/density steps (docs/DESIGN.md, quality).  Cost
            per rank and step: ``(N-1)/N * (bits + 32/quant_block)`` bits per
            parameter of the compressed units (N=2, int4: 2.06; ternary:
            0.86); memory: one residual per unit as every mode.
        quant_block: entries per fp32 scale in quant mode, 1..65536 (256:
            0.125 bits per entry of scale).
        ef21: EF21 feedback (Richtarik et al. 2021) instead of the residual:
            each rank keeps ``h``, its running estimate of its own gradient,
            and sends the compressed *change* ``C(g - h)`` (then ``h += C(g -
            h)``); each owner keeps the sum of every rank's ``h`` for its
            shard (a dense estimate, ``est += what arrived``) and hands that
            to the optimizer every step.  Why: residual feedback delivers
            what it held back late, all at once, so the optimizer sees a
            delayed and bursty gradient; EF21's estimate follows the current
            gradient and is never owed anything.  In the ablation it turned
            the coarse ternary code from +0.6%/+1.2% to +0.2%/+0.2% loss at
            300/1000 steps (docs/DESIGN.md).  Cost: the same bytes; memory:
            the residual buffer holds ``-h`` (as before, one unit per rank)
            plus one fp32 estimate of the owner's shard (1/N of the unit).
            Needs ``error_feedback`` and float32 residuals (a rounded ``h``
            would drift from the owner's sum); not in ``dense`` mode.
    """

    mode: str = "exact"
    theta: Optional[float] = None
    ratio: Optional[float] = None
    index_bits: int = 1
    value_dtype: Any = torch.float32
    layers: LayerPolicy = "non_attention"
    min_numel: int = 2 ** 16
    error_feedback: bool = True
    seed: int = 0
    residual_dtype: Any = torch.float32
    sketch_factor: float = 1.3
    dense_steps: int = 0
    warmup_steps: int = 0
    warmup_theta: float = 0.75
    quant_format: str = "int4"
    quant_block: int = 256
    ef21: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {self.mode!r}")
        for name in ("theta", "ratio", "sketch_factor"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{name}: must be a number, got {v!r}")
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
        if isinstance(self.index_bits, bool) or self.index_bits not in (1, 2, 4, 8):
            raise ValueError(f"index_bits: must be 1, 2, 4 or 8, got {self.index_bits!r}")
        self.value_dtype = _parse_dtype(self.value_dtype, "value_dtype")
        self.residual_dtype = _parse_dtype(self.residual_dtype, "residual_dtype")
        if isinstance(self.layers, str):
            if self.layers not in ("non_attention", "all"):
                raise ValueError(f"layers: must be 'non_attention', 'all' or a callable, "
                                 f"got {self.layers!r}")
        elif not callable(self.layers):
            raise ValueError(f"layers: must be 'non_attention', 'all' or a callable, "
                             f"got {self.layers!r}")
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) \
                or self.min_numel < 0:
            raise ValueError(f"min_numel: must be an int >= 0, got {self.min_numel!r}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback: must be a bool, got {self.error_feedback!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not (0 <= self.seed < 2 ** 64):
            raise ValueError(f"seed: must be an int in [0, 2^64), got {self.seed!r}")
        if not math.isfinite(self.sketch_factor) or self.sketch_factor <= 0:
            raise ValueError(f"sketch_factor: must be a finite number > 0, "
                             f"got {self.sketch_factor!r}")
        self.sketch_factor = float(self.sketch_factor)
        for name in ("dense_steps", "warmup_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {v!r}")
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
                             "mode 'exact'/'sparse'")
        if self.quant_format not in QUANT_FORMATS:
            raise ValueError(f"quant_format: must be one of {QUANT_FORMATS}, "
                             f"got {self.quant_format!r}")
        b = self.quant_block
        if isinstance(b, bool) or not isinstance(b, int) or not (1 <= b <= 65536):
            raise ValueError(f"quant_block: must be an int in [1, 65536], got {b!r}")
        if not isinstance(self.ef21, bool):
            raise ValueError(f"ef21: must be a bool, got {self.ef21!r}")
        if self.ef21 and (self.mode == "dense" or not self.error_feedback
                          or self.residual_dtype != torch.float32):
            raise ValueError("ef21: needs a compressing mode, error_feedback=True and "
                             "residual_dtype float32 (the ranks' estimates must add up to "
                             "the owner's exactly)")

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

    # -- (de)serialisation
    def to_dict(self) -> Dict[str, Any]:
        """Plain-data view (dtypes as names, a callable policy as its qualified name).

        Returns:
            dict accepted by :meth:`from_dict` (except for callable ``layers``).
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
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str) -> "TAGCConfig":
        """Load a YAML preset (e.g. ``configs/tagc-10x-1bit.yaml``); unknown keys raise.

        Args:
            path: YAML file holding a mapping of field names to values.
        Returns:
            the validated config.
        """
        import yaml

        with open(path, "r", encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        return cls.from_dict(data)

    def fingerprint(self) -> str:
        """Stable digest of the config, compared across ranks at register()."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- selection

def _clean_name(name: str) -> str:
    return ".".join(p for p in name.split(".") if p and p not in _WRAPPER_NAMES)


def _is_qkv_name(module_name: str) -> bool:
    parts = [p.lower() for p in _clean_name(module_name).split(".") if p]
    if not parts:
        return False
    last = parts[-1]
    if last in _QKV_ALWAYS:
        return True
    in_attn = any("attn" in p or "attention" in p for p in parts[:-1])
    return in_attn and last in _QKV_IN_ATTN


def select_parameter(cfg: TAGCConfig, module_name: str, module: nn.Module,
                     param_name: str, param: torch.Tensor) -> bool:
    """Whether ``cfg.layers`` selects one parameter for compression.

    ``"non_attention"``: the ``weight`` of an ``nn.Linear`` or ``nn.Embedding``
    with at least ``min_numel`` elements, unless the module is an attention
    QKV projection: its last name component is one of ``c_attn, qkv,
    qkv_proj, query_key_value, wqkv, in_proj, to_qkv``, or one of ``q_proj,
    k_proj, v_proj, query, key, value, wq, wk, wv, q, k, v, to_q/k/v,
    q/k/v_lin`` below a module whose name contains ``attn``/``attention``.
    The attention output projection (``c_proj``, ``o_proj``, ``out_proj``)
    is compressed, as in the paper.  ``"all"``: every parameter with at least
    ``min_numel`` elements.  A callable decides alone.

    Args:
        cfg: the config.
        module_name: FQN of the module owning the parameter (wrapper names ignored).
        module: that module.
        param_name: the parameter's name inside the module.
        param: the parameter.
    Returns:
        True if the parameter is compressed.
    """
    if callable(cfg.layers):
        return bool(cfg.layers(_clean_name(module_name), module, param_name, param))
    if param.numel() < cfg.min_numel or not param.is_floating_point():
        return False
    if cfg.layers == "all":
        return True
    if param_name != "weight" or not isinstance(module, (nn.Linear, nn.Embedding)):
        return False
    return not _is_qkv_name(module_name)


def _tied_param_ids(model: nn.Module) -> set:
    seen: Dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for _, p in mod.named_parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, c in seen.items() if c > 1}


def _modules_to_wrap(model: nn.Module, cfg: TAGCConfig) -> List[nn.Module]:
    """Modules that get their own FSDP unit: owners of selected parameters and big
    unselected Linear/Embedding layers (so they do not dilute another unit)."""
    tied = _tied_param_ids(model)
    out = []
    for name, mod in model.named_modules():
        if mod is model:
            continue
        direct = list(mod.named_parameters(recurse=False))
        if not direct or any(id(p) in tied for _, p in direct):
            continue  # tied weights must stay in a common ancestor's unit (the root)
        selected = any(select_parameter(cfg, name, mod, pn, p) for pn, p in direct)
        big_layer = isinstance(mod, (nn.Linear, nn.Embedding)) and \
            sum(p.numel() for _, p in direct) >= max(cfg.min_numel, 1)
        if selected or big_layer:
            out.append(mod)
    return out


def fsdp1_auto_wrap_policy(model: nn.Module, cfg: TAGCConfig) -> Callable[..., bool]:
    """FSDP1 ``auto_wrap_policy`` putting selected parameters in their own units.

    Every module owning a selected parameter, and every other ``nn.Linear``/
    ``nn.Embedding`` with at least ``min_numel`` parameters, becomes one unit;
    everything else (norms, position embeddings, tied weights) stays in the root.

    Args:
        model: the unwrapped model (the policy is computed from it).
        cfg: the config whose ``layers``/``min_numel`` decide the selection.
    Returns:
        a callable ``(module, recurse, nonwrapped_numel) -> bool`` for
        ``FullyShardedDataParallel(model, auto_wrap_policy=...)``.
    """
    wrap_ids = {id(m) for m in _modules_to_wrap(model, cfg)}

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True
        return id(module) in wrap_ids

    return policy


def shard_model(model: nn.Module, cfg: TAGCConfig, **fully_shard_kwargs: Any) -> nn.Module:
    """FSDP2: ``fully_shard`` each module of :func:`fsdp1_auto_wrap_policy`'s set, then the root.

    Args:
        model: the unsharded model.
        cfg: the config deciding the selection.
        **fully_shard_kwargs: passed to every ``fully_shard`` call (mesh, mp_policy, ...).
    Returns:
        the model (sharded in place; it is an ``FSDPModule`` afterwards).
    """
    from torch.distributed.fsdp import fully_shard

    mods = _modules_to_wrap(model, cfg)
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    for mod in sorted(mods, key=lambda m: -order[id(m)]):  # children before parents
        fully_shard(mod, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model


# --------------------------------------------------------------------------- per-unit state

_COUNTERS = ("calls", "compressed_calls", "plain_calls", "dense_step_calls",
             "nonfinite_fallbacks",
             "bytes_handed", "wire_bytes", "default_wire_bytes", "control_bytes",
             "unpeeled", "recovered", "union_size", "shard_slots",
             "collision_dropped", "collision_dropped_l1")


class _Unit:
    """State of one FSDP unit: identity, residual, step counter and statistics."""

    def __init__(self, owner: "TAGCState", name: str, index: int, numel: int,
                 flat_numel: int, selected_numel: int, compressed: bool, group: Any,
                 pre: float, post: float, device: torch.device) -> None:
        self.owner = owner
        self.name = name
        # Position in the FQN order of the model's FSDP units: identical on every
        # rank (same model code), which is what the hash seeds need; call order
        # is not (FSDP may reduce units in a different order under prefetching).
        self.index = index
        self.numel = numel
        # Elements of the reduce-scatter input (parameters padded to N shards):
        # the residual's length, known before the first backward so that a
        # checkpoint template (torch.distributed.checkpoint) can be built then.
        self.flat_numel = flat_numel
        self.device = device  # where the gradient is reduced: the residual's home
        self.selected_numel = selected_numel
        self.compressed = compressed
        self.group = group
        self.pre = pre    # the default path's pre/post divide factors
        self.post = post
        self.step = 0
        self.residual: Optional[torch.Tensor] = None
        # EF21 only: the owner's running sum of every rank's estimate of this
        # rank's shard (fp32, one shard long).
        self.estimate: Optional[torch.Tensor] = None
        self.warned_unpeeled = False
        # CUDA only: the current call's "all ranks finite" device flag, which
        # gates the device counters (set in TAGCState._run_body).
        self.ok: Optional[torch.Tensor] = None
        self.reset_stats()

    def reset_stats(self) -> None:
        self.counters: Dict[str, float] = {c: 0 for c in _COUNTERS}
        # CUDA: data-dependent counters accumulate on the device (reading them
        # per call would be a host sync) and are read only by stats().
        self.dev_counters: Dict[str, torch.Tensor] = {}
        self.collectives: Dict[str, Dict[str, int]] = {}

    def add(self, name: str, value: Union[int, float, torch.Tensor]) -> None:
        """Add to a counter; a device tensor stays on the device until stats().

        Args:
            name: one of ``_COUNTERS``.
            value: a host number, or a 1-element CUDA tensor (gated by ``self.ok``).
        """
        if isinstance(value, torch.Tensor):
            v = value.reshape(-1)[:1].to(torch.float64, copy=True)
            if self.ok is not None:
                v = _gate(v, self.ok)
            acc = self.dev_counters.get(name)
            self.dev_counters[name] = v if acc is None else acc.add_(v)
        else:
            self.counters[name] += value

    def record(self, op: str, handed: int, wire: float, control: bool = False) -> None:
        c = self.collectives.setdefault(op, {"calls": 0, "bytes": 0})
        c["calls"] += 1
        c["bytes"] += int(handed)
        if op == "irecv":  # a receive buffer: listed, but nothing this rank sends
            return
        self.counters["bytes_handed"] += int(handed)
        self.counters["wire_bytes"] += wire
        if control:
            self.counters["control_bytes"] += int(handed)

    def stats(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"index": self.index, "numel": self.numel,
                             "selected_numel": self.selected_numel,
                             "compressed": self.compressed, "step": self.step}
        d.update(self.counters)
        for name, t in self.dev_counters.items():  # the one host read, off the hot path
            v = float(t.item())
            d[name] += int(v) if name != "collision_dropped_l1" else v
        if self.dev_counters.get("unpeeled") is not None and d["unpeeled"] \
                and not self.warned_unpeeled:
            self.warned_unpeeled = True
            logger.warning("TAGC unit %r: %d union entries left unpeeled so far on CUDA; "
                           "they got the median estimate (logged once per unit)",
                           self.name, d["unpeeled"])
        d["collectives"] = {k: dict(v) for k, v in self.collectives.items()}
        slots = d["shard_slots"]
        d["density"] = d["union_size"] / slots if slots else 0.0
        dw = self.counters["default_wire_bytes"]
        d["wire_ratio"] = self.counters["wire_bytes"] / dw if dw else 0.0
        return d


def _count(fn: Callable[..., Any], *args: Any, out_kw: str = "out",
           **kw: Any) -> Union[int, torch.Tensor]:
    """Call a codec function returning a count.

    Args:
        fn: the ``_tagc`` function; ``args[0]`` decides the device.
        *args, **kw: its arguments.
        out_kw: name of its device-scalar output keyword.
    Returns:
        on CPU the count as an int; on CUDA a 1-element int64 device tensor
        (reading it would be a host sync; it feeds :meth:`_Unit.add`).
    """
    dev = args[0].device
    if dev.type == "cuda":
        o = torch.empty(1, dtype=torch.int64, device=dev)
        fn(*args, **{out_kw: o}, **kw)
        return o
    return int(fn(*args, **kw))


def _stream_kw(t: torch.Tensor) -> Dict[str, int]:
    # On CUDA the hook body runs with its codec stream S current (see
    # TAGCState._run), so the current stream is S.
    if t.is_cuda:
        return {"stream": torch.cuda.current_stream(t.device).cuda_stream}
    return {}


def _issue(cuda: bool, async_op: bool, fn: Callable[..., Any], *args: Any,
           **kw: Any) -> Any:
    """Issue one torch.distributed collective.

    On CPU exactly ``fn(..., async_op=async_op)``.  On CUDA always async: a
    caller that wants the result now gets ``work.wait()`` called here, with
    the codec stream current, which for NCCL makes that stream wait for the
    collective (a stream wait, not a host wait).

    Args:
        cuda: the tensors are CUDA tensors.
        async_op: the caller waits on the returned work itself.
        fn: the collective; ``*args``/``**kw`` its arguments.
    Returns:
        the work object if ``async_op``, else None.
    """
    if not cuda:
        return fn(*args, async_op=async_op, **kw)
    work = fn(*args, async_op=True, **kw)
    if async_op:
        return work
    work.wait()
    return None


def _gate(value: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``value`` where ``ok``, else 0, without reading ``ok`` on the host.

    Args:
        value: any tensor.
        ok: bool tensor broadcastable to ``value`` (1 element: the call's
            "every rank's gradient is finite" flag).
    Returns:
        a new tensor; ``torch.where`` selects, so NaN/Inf in ``value`` do not
        leak through a False ``ok`` (a product ``value * ok`` would give NaN).
    """
    return torch.where(ok, value, torch.zeros_like(value))


def _poison_nonfinite(grad2d: torch.Tensor, bad: torch.Tensor) -> None:
    """If ``bad``, write NaN into element 0 of every shard (row) of ``grad2d``, in place.

    The sync-free form of the non-finite fallback (CUDA): when any rank's
    gradient holds NaN/Inf, every rank poisons every shard, so the CUDA
    sparsify of every shard sees NaN and, by its contract (cuda/tagc_cuda.h),
    leaves the residual untouched and sends NaN values that reach every
    owner's decoded shard, where GradScaler finds them.  When ``bad`` is
    False the rows are rewritten with their own values (no change).

    Args:
        grad2d: ``(N, S)`` view of the unit gradient: FSDP's scratch buffer,
            which FSDP drops after the reduce-scatter (FSDP1's default path
            pre-divides it in place too).
        bad: 1-element bool tensor on the same device.
    """
    col = grad2d[:, 0]
    col.copy_(torch.where(bad, torch.full_like(col, float("nan")), col))


def _local_part(t: Any) -> torch.Tensor:
    """This rank's tensor of a state-dict entry: a DTensor's local shard, or the tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"load_state_dict: expected a tensor, got {type(t).__name__}")
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class TAGCState:
    """What :func:`register` returns: the per-unit states, stats and checkpoints.

    Not constructed directly.
    """

    def __init__(self, cfg: TAGCConfig, kind: str) -> None:
        self.cfg = cfg
        self.kind = kind
        self.units: List[_Unit] = []
        self.rank = 0
        self.world_size = 1
        self._streams: Dict[Optional[int], Any] = {}  # CUDA codec stream per device index
        self._meshes: Dict[int, Any] = {}  # checkpoint DeviceMesh per process group

    # ----------------------------------------------------------------- public
    def stats(self) -> Dict[str, Any]:
        """Statistics since registration (or :meth:`reset_stats`).

        Returns:
            ``{"units": {name: {...}}, "total": {...}, "compressed_total": {...}}``.
            Per entry: ``calls``, ``compressed_calls``, ``plain_calls`` (plain
            reduce-scatter), ``dense_step_calls`` (those of them in the
            warm-up's ``dense_steps``), ``nonfinite_fallbacks``, ``collectives`` (per
            torch.distributed function: calls and bytes of the tensors handed
            to it, i.e. the send buffer), ``bytes_handed`` (their sum),
            ``wire_bytes`` (bytes this rank sends on an ideal network: all-to-all
            minus its own chunk, isend all of it (``irecv`` entries list the
            receive buffers and add nothing to the byte totals), ring all-reduce ``2(N-1)/N``, reduce: all unless
            it is the destination, reduce-scatter ``(N-1)/N``), ``default_wire_bytes``
            (what FSDP's ideal ring reduce-scatter would send for the same
            calls: ``(N-1)/N * padded numel * element size``), ``wire_ratio``,
            ``control_bytes`` (non-finite agreement, unpeeled counts),
            ``unpeeled`` (entries peeling left; estimated in paper mode,
            recovered exactly in exact mode), ``recovered``, ``density`` (mean
            union size / shard size at the owner), ``collision_dropped`` and
            ``collision_dropped_l1`` (paper lanes: kept entries that the SUM
            carries erased from the union, counted by their senders, and the
            L1 mass lost with them).  On CUDA the data-dependent counters
            are accumulated on the device and read here (the only host
            syncs); a non-finite call counts in ``nonfinite_fallbacks`` only,
            and exact mode's ``unpeeled`` entries are estimated, not
            recovered (``recovered`` stays 0).
        """
        self._join_streams()
        units = {u.name: u.stats() for u in self.units}
        return {"units": units,
                "total": self._sum(list(units.values())),
                "compressed_total": self._sum([s for s in units.values() if s["compressed"]])}

    def reset_stats(self) -> None:
        """Zero every counter (residuals and step counters are kept)."""
        for u in self.units:
            u.reset_stats()

    def scale_residuals(self, factor: float) -> None:
        """Multiply every residual (and EF21 estimate) by ``factor``.

        Residuals hold gradient in the loss scale of the step that produced
        them; with dynamic loss scaling call this after ``scaler.update()``
        with ``new_scale / old_scale`` so the feedback stays in the new scale.

        Args:
            factor: finite positive multiplier.
        """
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"scale_residuals: factor must be finite and > 0, got {factor!r}")
        self._join_streams()
        for u in self.units:
            for name, _, _ in self._feedback_buffers(u):
                t = getattr(u, name)
                if t is not None and factor != 1.0:
                    t.mul_(factor)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's TAGC state: residuals per unit, step counters, seeds, config.

        Works both ways PyTorch checkpoints are written:

        * ``torch.save(state.state_dict(), f"tagc-rank{r}.pt")`` per rank, and
          ``state.load_state_dict(torch.load(...))`` on the same rank later;
        * ``torch.distributed.checkpoint``: ``dcp.save({"tagc": state}, ...)``
          and ``dcp.load({"tagc": state}, ...)`` (``TAGCState`` is a DCP
          ``Stateful``), beside the model and optimizer.

        Residuals differ per rank, everything else is identical on every rank.
        So each residual is a ``DTensor`` of global shape ``(N, flat_numel)``
        sharded by row over the unit's process group: DCP writes every rank's
        row and reads each row back into its rank (a plain tensor under one
        key would be de-duplicated as if replicated: one rank's residual for
        all).  ``rank`` is an ``(N,)`` DTensor holding each rank's own number,
        so a per-rank file loaded on the wrong rank is refused.  A compressed
        unit whose residual does not exist yet gets zeros and
        ``has_residual=False``: the template DCP loads into must have every
        tensor before the first backward.  With ``ef21`` the owner's estimate
        (``estimate``, ``has_estimate``; one shard long) is kept the same way.

        Returns:
            a dict of plain data and DTensors over CPU copies (``to_local()``
            gives this rank's ``(1, flat_numel)`` row).
        """
        self._join_streams()
        units: Dict[str, Any] = {}
        for u in self.units:
            entry: Dict[str, Any] = {"index": u.index, "numel": u.numel,
                                     "flat_numel": u.flat_numel, "step": u.step}
            for name, length, dtype in self._feedback_buffers(u):
                t = getattr(u, name)
                entry[f"has_{name}"] = t is not None
                row = (torch.zeros(length, dtype=dtype) if t is None
                       else t.detach().to("cpu", copy=True))
                entry[name] = self._rows(u.group, row.reshape(1, -1))
            units[u.name] = entry
        return {
            "format": "tagc-state-v2",
            "kind": self.kind,
            "world_size": self.world_size,
            "seed": self.cfg.seed,
            "config": self.cfg.to_dict(),
            "rank": self._rows(self.units[0].group if self.units else None,
                               torch.tensor([self.rank], dtype=torch.int64)),
            "units": units,
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output of the same rank of the same setup.

        Args:
            sd: the dict, from ``torch.load`` of this rank's file or filled in
                by ``torch.distributed.checkpoint``.
        Raises:
            ValueError: format, config, world size, rank, unit layout or a
                residual's size differ; nothing is changed then.
        """
        if not isinstance(sd, dict) or sd.get("format") != "tagc-state-v2":
            raise ValueError("load_state_dict: not a TAGC state dict (format tagc-state-v2)")
        if sd["config"] != self.cfg.to_dict():
            raise ValueError(f"load_state_dict: config differs: saved {sd['config']}, "
                             f"current {self.cfg.to_dict()}")
        saved_rank = int(_local_part(sd["rank"]).reshape(-1)[0])
        if sd["world_size"] != self.world_size or saved_rank != self.rank:
            raise ValueError(f"load_state_dict: saved by rank {saved_rank} of "
                             f"{sd['world_size']}, loading on rank {self.rank} of "
                             f"{self.world_size}")
        names = [u.name for u in self.units]
        if sorted(sd["units"]) != sorted(names):
            raise ValueError(f"load_state_dict: unit layout differs: saved "
                             f"{sorted(sd['units'])}, current {sorted(names)}")
        rows: Dict[Tuple[str, str], Optional[torch.Tensor]] = {}
        for u in self.units:
            entry = sd["units"][u.name]
            if (entry["numel"], entry["flat_numel"], entry["index"]) != \
                    (u.numel, u.flat_numel, u.index):
                raise ValueError(f"load_state_dict: unit {u.name!r} differs (numel "
                                 f"{entry['numel']}/{entry['flat_numel']} saved, "
                                 f"{u.numel}/{u.flat_numel} now)")
            for name, length, _ in self._feedback_buffers(u):
                row = None
                if entry.get(f"has_{name}"):
                    row = _local_part(entry[name]).reshape(-1)
                    if row.numel() != length:
                        raise ValueError(f"load_state_dict: unit {u.name!r}: {name} of "
                                         f"{row.numel()} elements, expected {length}")
                rows[u.name, name] = row
        self._join_streams()  # the old residuals may still be in use on a codec stream
        for u in self.units:
            u.step = int(sd["units"][u.name]["step"])
            for name, _, dtype in self._feedback_buffers(u):
                row, old = rows[u.name, name], getattr(u, name)
                dev = old.device if old is not None else u.device
                setattr(u, name, None if row is None else
                        row.detach().to(device=dev, dtype=dtype, copy=True).contiguous())

    # ----------------------------------------------------------------- internals
    def _keeps_residual(self, u: _Unit) -> bool:
        """Whether ``u`` gets an error-feedback residual (checkpoints hold exactly these)."""
        return u.compressed and self.cfg.error_feedback and self.cfg.mode != "dense"

    def _feedback_buffers(self, u: _Unit) -> List[Tuple[str, int, torch.dtype]]:
        """(attribute, length, dtype) of each per-rank feedback state of ``u``:
        the residual, and with ``ef21`` the owner's estimate of its shard."""
        if not self._keeps_residual(u):
            return []
        out = [("residual", u.flat_numel, self.cfg.residual_dtype)]
        if self.cfg.ef21:
            out.append(("estimate", u.flat_numel // self.world_size, torch.float32))
        return out

    def _rows(self, group: Any, local: torch.Tensor) -> Any:
        """``local`` (this rank's row, CPU) as row ``rank`` of a DTensor over ``group``."""
        from torch.distributed.tensor import DTensor, Shard

        if group is None:
            group = dist.group.WORLD
        key = id(group)
        mesh = self._meshes.get(key)
        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            # "cpu": the rows are host copies; DCP moves only local shards and
            # never runs a collective on this mesh.
            mesh = self._meshes[key] = DeviceMesh.from_group(group, "cpu")
        n = dist.get_world_size(group)
        shape = torch.Size([n * local.shape[0], *local.shape[1:]])
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=shape, stride=torch.empty(shape, device="meta").stride())

    @staticmethod
    def _sum(entries: List[Dict[str, Any]]) -> Dict[str, Any]:
        tot: Dict[str, Any] = {c: 0 for c in _COUNTERS}
        coll: Dict[str, Dict[str, int]] = {}
        for e in entries:
            for c in _COUNTERS:
                tot[c] += e[c]
            for op, v in e["collectives"].items():
                cc = coll.setdefault(op, {"calls": 0, "bytes": 0})
                cc["calls"] += v["calls"]
                cc["bytes"] += v["bytes"]
        tot["collectives"] = coll
        tot["units"] = len(entries)
        tot["density"] = tot["union_size"] / tot["shard_slots"] if tot["shard_slots"] else 0.0
        dw = tot["default_wire_bytes"]
        tot["wire_ratio"] = tot["wire_bytes"] / dw if dw else 0.0
        return tot

    # collectives: every one goes through these so the stats match what was
    # handed to torch.distributed.
    def _a2a(self, u: _Unit, out: torch.Tensor, inp: torch.Tensor,
             in_splits: Optional[List[int]] = None, out_splits: Optional[List[int]] = None,
             async_op: bool = False, control: bool = False) -> Any:
        n, rank = self.world_size, self.rank
        rows = inp.shape[0] if inp.dim() > 0 else 0
        if in_splits is None:
            own = inp.numel() // n if n else 0
        else:
            per_row = inp.numel() // max(rows, 1) if inp.dim() > 0 else 0
            own = in_splits[rank] * per_row
        wire = (inp.numel() - own) * inp.element_size()
        u.record("all_to_all_single", inp.numel() * inp.element_size(), wire, control)
        return _issue(out.is_cuda, async_op, dist.all_to_all_single, out, inp,
                      output_split_sizes=out_splits, input_split_sizes=in_splits,
                      group=u.group)

    def _all_reduce(self, u: _Unit, t: torch.Tensor, async_op: bool = False,
                    control: bool = False) -> Any:
        n = self.world_size
        nb = t.numel() * t.element_size()
        u.record("all_reduce", nb, 2.0 * (n - 1) / n * nb, control)
        return _issue(t.is_cuda, async_op, dist.all_reduce, t, op=dist.ReduceOp.SUM,
                      group=u.group)

    def _reduce(self, u: _Unit, t: torch.Tensor, dst_group_rank: int,
                async_op: bool = False) -> Any:
        nb = t.numel() * t.element_size()
        u.record("reduce", nb, 0 if dst_group_rank == self.rank else nb)
        dst = dist.get_global_rank(u.group, dst_group_rank) if u.group is not None \
            else dst_group_rank
        return _issue(t.is_cuda, async_op, dist.reduce, t, dst=dst, op=dist.ReduceOp.SUM,
                      group=u.group)

    def _p2p(self, u: _Unit, send: bool, t: torch.Tensor, peer: int) -> Any:
        """Post one async ``dist.isend``/``dist.irecv`` with group rank ``peer``.

        Args:
            u: the unit (stats).
            send: isend if true, else irecv.
            t: the buffer.
            peer: the other rank, relative to ``u.group``.
        Returns:
            the work object (CPU only; CUDA pairs its ops, see ``_sparse``).
        """
        nb = t.numel() * t.element_size()
        if send:
            u.record("isend", nb, nb)
            return dist.isend(t, group=u.group, group_dst=peer)
        u.record("irecv", nb, 0)
        return dist.irecv(t, group=u.group, group_src=peer)

    def _reduce_scatter(self, u: _Unit, out: torch.Tensor, inp: torch.Tensor) -> None:
        n = self.world_size
        nb = inp.numel() * inp.element_size()
        if hasattr(dist, "reduce_scatter_single"):  # reduce_scatter_tensor is deprecated
            u.record("reduce_scatter_single", nb, (n - 1) / n * nb)
            _issue(out.is_cuda, False, dist.reduce_scatter_single, out, inp,
                   op=dist.ReduceOp.SUM, group=u.group)
        else:  # pragma: no cover - older torch
            u.record("reduce_scatter_tensor", nb, (n - 1) / n * nb)
            _issue(out.is_cuda, False, dist.reduce_scatter_tensor, out, inp,
                   op=dist.ReduceOp.SUM, group=u.group)

    # ----------------------------------------------------------------- one call
    def _codec_stream(self, device: torch.device) -> "torch.cuda.Stream":
        key = torch.device(device).index
        if key is None:
            key = torch.cuda.current_device()
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device=key)
        return stream

    def _join_streams(self) -> None:
        """Order the caller's current stream after all codec work (before host reads)."""
        for key, stream in self._streams.items():
            torch.cuda.current_stream(key).wait_stream(stream)

    def _run(self, u: _Unit, inp: torch.Tensor, out: torch.Tensor) -> None:
        """Reduce one unit: ``out`` = what the default reduce-scatter would produce.

        Called by FSDP2 on its reduce-scatter stream and by FSDP1 on its
        post-backward stream (R below).  On CUDA the work runs on this state's
        codec stream S of the device and the host only enqueues::

          R  (FSDP reduce-scatter): copy-in(g) ─ev0┐                                      ┌wait(S)─ FSDP post-reduce
          S  (TAGC codec):              wait(ev0) ─ sparsify shards ─ lanes/sketch ─┐ ... bitmap_or/popcount/peel/unpack(out) ─┘
          NCCL (ProcessGroupNCCL):                             after S ─ a2a(bitmaps) ─ a2a(sketches) ─ work.wait() on S
          AG (FSDP all-gather prefetch of the next unit): runs concurrently with all of the above
          Host: only enqueues; no synchronize / .item()

        ``R.wait_stream(S)`` happens before returning because FSDP records its
        reduce-scatter event on R right after the comm returns.  ``inp`` and
        ``out`` belong to FSDP's streams, so they are ``record_stream``-ed on
        S; everything else (residuals, buffers, device counters) is allocated
        while S is current.  Data-dependent decisions never reach the host on
        CUDA: see :func:`_poison_nonfinite` (non-finite gradients) and
        :meth:`_exact` (no recovery exchange on CUDA).
        """
        if not inp.is_cuda:
            self._run_body(u, inp, out)
            return
        r_stream = torch.cuda.current_stream(inp.device)
        s_stream = self._codec_stream(inp.device)
        s_stream.wait_stream(r_stream)
        inp.record_stream(s_stream)
        out.record_stream(s_stream)
        try:
            with torch.cuda.stream(s_stream):
                self._run_body(u, inp, out)
        finally:
            u.ok = None
            r_stream.wait_stream(s_stream)

    def _run_body(self, u: _Unit, inp: torch.Tensor, out: torch.Tensor) -> None:
        if not inp.is_floating_point() or not out.is_floating_point():
            raise TypeError(f"TAGC: unit {u.name!r} has a non-floating gradient "
                            f"({inp.dtype}); only floating gradients can be reduced")
        n = self.world_size
        if inp.numel() != n * out.numel():
            raise RuntimeError(f"TAGC: unit {u.name!r}: input of {inp.numel()} elements "
                               f"does not split into {n} shards of {out.numel()}")
        inp = inp.reshape(-1)
        if not inp.is_contiguous():
            inp = inp.contiguous()
        u.counters["calls"] += 1
        u.counters["default_wire_bytes"] += (n - 1) / n * inp.numel() * inp.element_size()
        if out.numel() == 0:
            return
        if u.compressed and inp.numel() != u.flat_numel:
            # The residual is indexed by position in this buffer; a buffer of
            # another length (FSDP2 leaves out parameters without a gradient)
            # would mix up parameters.  Sizes agree across ranks, so every
            # rank raises here, none waits in a collective.
            raise RuntimeError(f"TAGC: unit {u.name!r}: reduce-scatter input has "
                               f"{inp.numel()} elements, expected {u.flat_numel} (every "
                               "parameter of a compressed unit that requires grad at "
                               "register() must get a gradient each step; FSDP2: "
                               "set_reduce_scatter_unused_params(True) sends zeros for "
                               "unused ones)")
        if not u.compressed:
            self._plain(u, inp, out)
            return
        theta = self.cfg.theta_at(u.step)
        if theta is None:
            # Warm-up's dense steps: u.step is the same on every rank, so all
            # take this path together.  Non-finite values need no agreement
            # here: the plain path passes them on and no residual exists yet.
            u.counters["dense_step_calls"] += 1
            self._plain(u, inp, out)
            u.step += 1
            return
        mode = self.cfg.mode
        if mode != "dense":
            _require_codec()
        # Ranks must agree before any residual is touched; the flag rides on a
        # 4-byte all-reduce.
        if inp.is_cuda:
            # Sync-free: the flag stays on the device.  A non-finite call still
            # takes the compressed path, with every shard poisoned so that no
            # residual changes and the NaN reaches every owner's output (dense
            # sums values, so NaN/Inf reach the owners without poisoning).
            # Unlike CPU, the call counts in `nonfinite_fallbacks` only and
            # advances `step` (identically on every rank, so seeds still agree).
            flag = (~torch.isfinite(inp).all()).to(torch.int32).reshape(1)
            self._all_reduce(u, flag, control=True)
            bad = flag > 0
            u.add("nonfinite_fallbacks", bad)
            u.ok = ~bad
            u.add("compressed_calls", u.ok)
            if mode != "dense":
                _poison_nonfinite(inp.view(n, -1), bad)
        else:
            flag = torch.zeros(1, dtype=torch.int32, device=inp.device)
            if not bool(torch.isfinite(inp).all()):
                flag.fill_(1)
            self._all_reduce(u, flag, control=True)
            if int(flag.item()) != 0:
                u.counters["nonfinite_fallbacks"] += 1
                self._plain(u, inp, out)
                return
            u.counters["compressed_calls"] += 1
        acc = torch.empty(out.numel(), dtype=torch.float32, device=out.device)
        if mode == "dense":
            self._dense(u, inp, acc)
        else:
            if self._keeps_residual(u) and u.residual is None:
                u.residual = torch.zeros(u.flat_numel, dtype=self.cfg.residual_dtype,
                                         device=inp.device)
            if mode == "exact":
                self._exact(u, inp, acc)
            elif mode == "sparse":
                self._sparse(u, inp, acc)
            elif mode == "quant":
                self._quant(u, inp, acc)
            elif mode == "paper":
                self._paper(u, inp, acc)
            else:  # pragma: no cover - config validation forbids it
                raise NotImplementedError(mode)
        if self.cfg.ef21 and mode != "dense":
            self._ef21_update(u, inp, acc)
        u.step += 1
        divisor = u.pre * u.post
        if divisor != 1:
            acc.div_(divisor)
        out.copy_(acc)

    def _ef21_update(self, u: _Unit, inp: torch.Tensor, acc: torch.Tensor) -> None:
        """EF21 after a transport: ``acc`` holds what every rank sent for this
        rank's shard, the residual ``v - sent`` with ``v = g - h``.

        ``h' = h + sent = g - (v - sent)``, stored negated: residual -= g.
        The owner's estimate takes what arrived and becomes the output.  On
        CUDA the updates are gated by the call's "all finite" flag (a
        poisoned call leaves both states as they were and passes the NaN on).
        """
        if u.estimate is None:
            u.estimate = torch.zeros(acc.numel(), dtype=torch.float32, device=acc.device)
        if u.ok is None:
            u.residual.sub_(inp)
            u.estimate.add_(acc)
            acc.copy_(u.estimate)
            return
        u.residual.sub_(_gate(inp, u.ok))
        new = u.estimate + acc
        u.estimate.copy_(torch.where(u.ok, new, u.estimate))
        acc.copy_(torch.where(u.ok, new, acc))

    def _plain(self, u: _Unit, inp: torch.Tensor, out: torch.Tensor) -> None:
        # Exactly the default path's arithmetic: pre-divide, SUM reduce-scatter,
        # post-divide (gloo's AVG has been unreliable, so SUM is used always).
        u.counters["plain_calls"] += 1
        if u.pre != 1:
            inp = inp / u.pre
        if self.world_size == 1:
            out.copy_(inp)
        else:
            self._reduce_scatter(u, out, inp)
        if u.post != 1:
            out.div_(u.post)

    @staticmethod
    def _note_unpeeled(u: _Unit, cnt: Union[int, torch.Tensor],
                       usize: Union[int, torch.Tensor], what: str) -> None:
        if isinstance(cnt, torch.Tensor):  # CUDA: stats() warns instead
            u.add("unpeeled", cnt)
            return
        u.counters["unpeeled"] += cnt
        if cnt and not u.warned_unpeeled:
            u.warned_unpeeled = True
            logger.warning("TAGC unit %r: %d of %d union entries left unpeeled at step %d; "
                           "%s (logged once per unit)", u.name, cnt, usize, u.step, what)

    def _k(self, u: _Unit, s: int) -> int:
        """Entries kept per shard at the unit's current step (warm-up schedule)."""
        theta = self.cfg.theta_at(u.step)
        assert theta is not None  # dense steps never reach the codecs
        # round() guards against (1 - 0.9875) * 800 == 10.000000000000009
        k = math.ceil(round((1.0 - theta) * s, 9))
        return min(max(k, 1), s)

    def _sparsify_all(self, u: _Unit, inp: torch.Tensor, s: int, k: int,
                      with_bitmap: bool = True,
                      per_shard: Optional[Callable[..., None]] = None,
                      order: Optional[Sequence[int]] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.world_size
        dev = inp.device
        idx = torch.empty(n, k, dtype=torch.int32, device=dev)
        val = torch.empty(n, k, dtype=self.cfg.value_dtype, device=dev)
        nb = (s + 7) // 8
        bm = torch.empty(n if with_bitmap else 1, nb, dtype=torch.uint8, device=dev)
        kw = _stream_kw(inp)
        # on CUDA the threshold goes to a device scalar (no host sync)
        tau = torch.empty(n, dtype=torch.float32, device=dev) if inp.is_cuda else None
        # Shards are independent (disjoint residual slices), so the order does
        # not change any result; it only decides which exchange starts first.
        for r in (range(n) if order is None else order):
            res = u.residual[r * s:(r + 1) * s] if u.residual is not None else None
            if tau is not None:
                kw["out"] = tau[r:r + 1]
            _tagc.sparsify(idx[r], val[r], bm[r if with_bitmap else 0], res,
                           inp[r * s:(r + 1) * s], k, **kw)
            if per_shard is not None:  # start shard r's exchange before selecting r+1
                per_shard(r, idx, val, bm)
        return idx, val, bm

    def _dense(self, u: _Unit, inp: torch.Tensor, acc: torch.Tensor) -> None:
        n = self.world_size
        send = inp.view(n, -1)
        recv = torch.empty_like(send)
        self._a2a(u, recv, send)
        torch.sum(recv.float(), dim=0, out=acc)

    @staticmethod
    def _ring(n: int, rank: int) -> List[int]:
        """Owners in ring order from ``rank + 1``: at each step the ranks target
        different owners; the own shard comes last and stays local."""
        return [(rank + 1 + i) % n for i in range(n)]

    def _post_recvs(self, u: _Unit, recv: torch.Tensor) -> List[Any]:
        """Receives of row ``r`` of ``recv`` from every other rank ``r`` (CPU;
        on CUDA each receive is batched with a send in :meth:`_post_send`)."""
        if recv.is_cuda:
            return []
        return [self._p2p(u, False, recv[r], r) for r in range(self.world_size)
                if r != self.rank]

    def _post_send(self, u: _Unit, works: List[Any], buf: torch.Tensor,
                   recv: torch.Tensor, r: int) -> None:
        """Send row ``r`` of ``buf`` (shard r's message) to its owner ``r``.

        Every message size is known up front (fixed per shard), so the
        receives are posted first (:meth:`_post_recvs`) and shard ``r`` goes
        out while shard ``r+1`` is encoded.
        """
        if not buf.is_cuda:
            works.append(self._p2p(u, True, buf[r], r))
            return
        # NCCL: a lone recv ahead of a lone send deadlocks between two ranks,
        # so each send is batched with the ring-symmetric receive (at ring
        # step i this rank sends to rank+1+i and hears from rank-1-i).
        src = (2 * self.rank - r) % self.world_size
        nb = buf[r].numel()
        u.record("isend", nb, nb)
        u.record("irecv", nb, 0)
        c10d = dist.distributed_c10d
        works.extend(dist.batch_isend_irecv([
            dist.P2POp(c10d.isend, buf[r], group=u.group, group_peer=r),
            dist.P2POp(c10d.irecv, recv[src], group=u.group, group_peer=src)]))

    def _sparse(self, u: _Unit, inp: torch.Tensor, acc: torch.Tensor) -> None:
        n, s, rank = self.world_size, acc.numel(), self.rank
        k = self._k(u, s)
        esize = 4 + torch.empty(0, dtype=self.cfg.value_dtype).element_size()
        buf = torch.empty(n, k * esize, dtype=torch.uint8, device=inp.device)
        recv = torch.empty_like(buf)
        kw = _stream_kw(inp)
        # Exactly k pairs per shard, so every receive size is known up front.
        works = self._post_recvs(u, recv)

        def send(r: int, idx: torch.Tensor, val: torch.Tensor, bm: torch.Tensor) -> None:
            _tagc.sparse_pack(buf[r], idx[r], val[r], **kw)
            if r != rank:
                self._post_send(u, works, buf, recv, r)

        self._sparsify_all(u, inp, s, k, with_bitmap=False, per_shard=send,
                           order=self._ring(n, rank))
        for w in works:
            w.wait()  # on CUDA with the codec stream current: a stream wait
        acc.zero_()
        for r in range(n):  # rank order, as the all-to-all version summed
            _tagc.sparse_unpack(acc, buf[r] if r == rank else recv[r], k,
                                self.cfg.value_dtype, **kw)
        u.counters["shard_slots"] += s

    def _quant(self, u: _Unit, inp: torch.Tensor, acc: torch.Tensor) -> None:
        """Every other owner's shard on ``quant_format`` codes with error
        feedback; the own shard is added exact (it never leaves the rank)."""
        n, s, rank = self.world_size, acc.numel(), self.rank
        fmt, block = self.cfg.quant_format, self.cfg.quant_block
        buf = torch.empty(n, _tagc.quant_bytes(s, fmt, block), dtype=torch.uint8,
                          device=inp.device)
        recv = torch.empty_like(buf)
        kw = _stream_kw(inp)
        works = self._post_recvs(u, recv)
        for r in self._ring(n, rank)[:-1]:
            res = u.residual[r * s:(r + 1) * s] if u.residual is not None else None
            _tagc.quant_encode(buf[r], res, inp[r * s:(r + 1) * s], fmt, block, **kw)
            self._post_send(u, works, buf, recv, r)
        for w in works:
            w.wait()
        acc.zero_()
        for r in range(n):  # rank order: the same sum on every run
            if r != rank:
                _tagc.quant_decode_add(acc, recv[r], fmt, block, **kw)
                continue
            acc.add_(inp[r * s:(r + 1) * s])
            if self.cfg.ef21:
                # The own shard is "sent" uncompressed: it contributes v = g - h
                # in full and leaves nothing behind (so h becomes g).
                own = u.residual[r * s:(r + 1) * s]
                acc.add_(own)
                if u.ok is None:
                    own.zero_()
                else:  # CUDA: a poisoned call leaves the state as it was
                    own.copy_(torch.where(u.ok, torch.zeros_like(own), own))
        u.add("union_size", s)
        u.add("shard_slots", s)

    def _exact(self, u: _Unit, inp: torch.Tensor, acc: torch.Tensor) -> None:
        n, s, rank = self.world_size, acc.numel(), self.rank
        k = self._k(u, s)
        kw = _stream_kw(inp)
        idx, val, bm = self._sparsify_all(u, inp, s, k)
        recv_bm = torch.empty_like(bm)
        work = self._a2a(u, recv_bm, bm, async_op=True)
        # While the bitmaps travel, encode every shard's sketch.
        m = math.ceil(self.cfg.sketch_factor * min(s, n * k))
        t = max(1, math.ceil(m / 3))
        seed = _tagc.seed_derive(self.cfg.seed, u.index, u.step)
        sk = torch.empty(n, 3 * t, dtype=self.cfg.value_dtype, device=inp.device)
        for r in range(n):
            _tagc.sketch_encode(sk[r], idx[r], val[r], s, t, seed, **kw)
        recv_sk = torch.empty_like(sk)
        work_sk = self._a2a(u, recv_sk, sk, async_op=True)
        work.wait()
        union = torch.empty(bm.shape[1], dtype=torch.uint8, device=inp.device)
        _tagc.bitmap_or(union, recv_bm.view(-1), n, **kw)
        usize = _count(_tagc.popcount, union, s, **kw)
        work_sk.wait()
        total = recv_sk.float().sum(dim=0) if n > 1 else recv_sk[0].float()
        if inp.is_cuda:
            # No recovery exchange on CUDA: its sizes depend on the unpeeled
            # counts, which only the host could turn into splits.  Entries
            # peeling leaves (rare at sketch_factor >= 1.23) get the median
            # estimate of their buckets and are counted in `unpeeled`
            # (`recovered` stays 0): CUDA exact mode is lossless only when
            # `unpeeled` is 0.
            cnt_dev = _count(_tagc.peel_decode, acc, total, union, s, t, seed, estimate=True,
                             out_kw="count_out", **kw)
            u.add("union_size", usize)
            u.add("shard_slots", s)
            u.add("unpeeled", cnt_dev)
            return
        unpeeled = torch.empty(max(usize, 1), dtype=torch.int32, device=inp.device)
        cnt = _count(_tagc.peel_decode, acc, total, union, s, t, seed, unpeeled=unpeeled,
                     estimate=False, out_kw="count_out", **kw)
        u.counters["union_size"] += int(usize)
        u.counters["shard_slots"] += s
        # Agree on who needs recovery (an N-element all-reduce of counts).
        counts = torch.zeros(n, dtype=torch.int64, device=inp.device)
        counts[rank] = cnt
        self._all_reduce(u, counts, control=True)
        c = [int(x) for x in counts.tolist()]
        if sum(c) == 0:
            return
        u.counters["recovered"] += cnt
        self._note_unpeeled(u, cnt, usize, "recovered by a second exchange")
        # Owner names its unpeeled positions to every rank ...
        mine = unpeeled[:cnt]
        send_pos = mine.repeat(n) if cnt else torch.empty(0, dtype=torch.int32,
                                                          device=inp.device)
        recv_pos = torch.empty(sum(c), dtype=torch.int32, device=inp.device)
        self._a2a(u, recv_pos, send_pos, in_splits=[cnt] * n, out_splits=c, control=False)
        # ... each rank answers with its kept value there (0 if not kept) ...
        answers = torch.zeros(sum(c), dtype=self.cfg.value_dtype, device=inp.device)
        off = 0
        for r in range(n):
            if c[r]:
                pos = recv_pos[off:off + c[r]].long()
                kept = idx[r].long()
                j = torch.searchsorted(kept, pos).clamp_(max=k - 1)
                hit = kept[j] == pos
                answers[off:off + c[r]] = torch.where(hit, val[r][j],
                                                      torch.zeros_like(val[r][j]))
            off += c[r]
        got = torch.empty(n * cnt, dtype=self.cfg.value_dtype, device=inp.device)
        self._a2a(u, got, answers, in_splits=c, out_splits=[cnt] * n)
        # ... and the owner sums the answers: exact values, nothing lost.
        if cnt:
            acc[mine.long()] = got.view(n, cnt).float().sum(dim=0)

    def _paper(self, u: _Unit, inp: torch.Tensor, acc: torch.Tensor) -> None:
        n, s, rank = self.world_size, acc.numel(), self.rank
        k = self._k(u, s)
        bits = self.cfg.index_bits
        kw = _stream_kw(inp)
        lane_bytes = (s * bits + 7) // 8
        lanes = torch.empty(n, lane_bytes, dtype=torch.uint8, device=inp.device)
        t = max(1, math.ceil(math.ceil(s / self.cfg.ratio) / 3))
        seed = _tagc.seed_derive(self.cfg.seed, u.index, u.step)
        sk = torch.empty(n, 3 * t, dtype=self.cfg.value_dtype, device=inp.device)
        works: List[Any] = []

        def exchange(r: int, idx: torch.Tensor, val: torch.Tensor, bm: torch.Tensor) -> None:
            # Algorithm 1 per shard: SUM all-reduce of the lanes (carries included;
            # elementwise, so per-shard calls equal one call over the unit), then
            # the fixed-size sketch reduced to the owner.  Both run while shard
            # r+1 is selected and encoded.
            _tagc.lanes_pack(lanes[r], bm[r], s, bits, **kw)
            works.append(self._all_reduce(u, lanes[r], async_op=True))
            _tagc.sketch_encode(sk[r], idx[r], val[r], s, t, seed, **kw)
            works.append(self._reduce(u, sk[r], r, async_op=True))

        idx, val, bm = self._sparsify_all(u, inp, s, k, per_shard=exchange)
        for w in works:
            w.wait()
        union = torch.empty(bm.shape[1], dtype=torch.uint8, device=inp.device)
        _tagc.lanes_unpack(union, lanes[rank], s, bits, **kw)
        usize = _count(_tagc.popcount, union, s, **kw)
        cnt = _count(_tagc.peel_decode, acc, sk[rank], union, s, t, seed, estimate=True,
                     out_kw="count_out", **kw)
        u.add("union_size", usize)
        u.add("shard_slots", s)
        self._note_unpeeled(u, cnt, usize, "paper mode estimates them")
        # Collision loss: every rank sees all reduced lanes, so each counts its own
        # kept entries that the carries erased from the union (the paper's loss).
        ub = torch.empty_like(bm)
        for r in range(n):
            _tagc.lanes_unpack(ub[r], lanes[r], s, bits, **kw)
        pos = idx.long()
        bit = (ub.gather(1, pos >> 3).long() >> (pos & 7)) & 1
        lost = bit == 0
        if inp.is_cuda:  # boolean indexing would sync; where() keeps it on the device
            u.add("collision_dropped", lost.sum())
            u.add("collision_dropped_l1", _gate(val.float().abs(), lost).sum())
            return
        u.counters["collision_dropped"] += int(lost.sum())
        u.counters["collision_dropped_l1"] += float(val.float().abs()[lost].sum())


# --------------------------------------------------------------------------- FSDP glue

def _fsdp1_hook(unit: _Unit, padded_grad: torch.Tensor,
                output: Optional[torch.Tensor] = None) -> None:
    """The FSDP1 comm hook; FSDP passes each unit's own state (see register)."""
    if output is None:
        # NO_SHARD: register() admits it only with one rank (FSDP1 switches to it
        # by itself at world size 1), where the reduction is the identity.
        if unit.owner.world_size != 1:
            raise RuntimeError("TAGC: NO_SHARD is not supported with more than one rank")
        unit.counters["calls"] += 1
        unit.counters["plain_calls"] += 1
        if unit.pre * unit.post != 1:
            padded_grad.div_(unit.pre * unit.post)
        return
    unit.owner._run(unit, padded_grad, output)


try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _RSBase
except ImportError:  # pragma: no cover - older torch without custom comms
    _RSBase = object  # type: ignore[assignment,misc]


class _FSDP2Comm(_RSBase):  # type: ignore[misc,valid-type]
    """FSDP2 custom reduce-scatter: one object per FSDPModule, i.e. per unit."""

    def __init__(self, unit: _Unit) -> None:
        self.unit = unit

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, op: Any = None, async_op: bool = False) -> None:
        if op is not None and op != dist.ReduceOp.SUM:
            raise RuntimeError(f"TAGC: FSDP2 asked for reduce op {op}; register() forces "
                               "SUM (set_force_sum_reduction_for_comms) and owns the averaging")
        self.unit.group = group
        self.unit.owner._run(self.unit, input_tensor, output_tensor)
        return None


def _module_names(model: nn.Module) -> Dict[int, str]:
    return {id(m): _clean_name(n) for n, m in model.named_modules()}


def _unit_params(cfg: TAGCConfig, names: Dict[int, str],
                 infos: List[Tuple[nn.Module, str, torch.Tensor, int]]) -> Tuple[int, int]:
    total = sel = 0
    for mod, pname, p, numel in infos:
        total += numel
        if select_parameter(cfg, names.get(id(mod), ""), mod, pname, p):
            sel += numel
    return total, sel


def _register_fsdp1(model: nn.Module, cfg: TAGCConfig) -> TAGCState:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    if not model.check_is_root():
        raise ValueError("register: pass the root FSDP module (FSDP1 hooks are root-only)")
    state = TAGCState(cfg, "fsdp1")
    names = _module_names(model)
    fsdp_mods = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDP)]
    for name, m in fsdp_mods:
        if m._comm_hook is not None:
            raise RuntimeError(f"register: a communication hook is already registered on "
                               f"{name or '<root>'!r} (TAGC registered twice?)")
        strat = m.sharding_strategy
        if strat in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
            raise ValueError(f"register: sharding strategy {strat.name} is not supported "
                             "(FSDP1 comm hooks cannot run hybrid sharding); use FULL_SHARD "
                             "or SHARD_GRAD_OP")
        if strat == ShardingStrategy.NO_SHARD and dist.get_world_size(m.process_group) > 1:
            raise ValueError("register: sharding strategy NO_SHARD is not supported (it is "
                             "data parallel without sharding; use DDP and its comm hooks)")
    group = model.process_group
    state.world_size = dist.get_world_size(group)
    state.rank = dist.get_rank(group)
    index = 0
    owned: List[Tuple[nn.Module, _Unit]] = []
    for name, m in fsdp_mods:
        handle = m._handle
        if handle is None:
            continue
        fp = handle.flat_param
        infos = []
        for pi, numel, shape in zip(fp._param_infos, fp._numels, fp._shapes):
            p = getattr(pi.module, pi.param_name, None)
            if not isinstance(p, torch.Tensor) or p.numel() != numel:
                # use_orig_params=False removed the original; describe it by shape
                p = torch.empty(shape, dtype=fp.dtype, device="meta")
            infos.append((pi.module, pi.param_name, p, numel))
        total, sel = _unit_params(cfg, names, infos)
        flat = int(fp._sharded_size.numel()) * dist.get_world_size(m.process_group)
        unit = _Unit(state, _clean_name(name) or "<root>", index, int(total), flat, sel,
                     compressed=sel > 0 and 2 * sel >= total, group=m.process_group,
                     pre=float(m._gradient_predivide_factor),
                     post=float(m._gradient_postdivide_factor), device=handle.device)
        index += 1
        state.units.append(unit)
        owned.append((m, unit))
    _check_agreement(state, group)
    model.register_comm_hook(owned[0][1] if owned else None, _fsdp1_hook)
    # register_comm_hook gave every unit the same state; give each its own so
    # residuals follow the unit, never numel or call order.
    for m, unit in owned:
        m._comm_hook_state = unit
    _log_units(state)
    return state


def _register_fsdp2(model: nn.Module, cfg: TAGCConfig) -> TAGCState:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    state = TAGCState(cfg, "fsdp2")
    names = _module_names(model)
    mods = []
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        fstate = m._get_fsdp_state()
        groups = list(getattr(fstate, "_fsdp_param_groups", []))
        if not groups:
            continue
        if len(groups) > 1:
            raise ValueError(f"register: FSDP2 module {name!r} has several parameter groups "
                             "(per-parameter meshes); TAGC needs one per module")
        pg = groups[0]
        if isinstance(pg.mesh_info, HSDPMeshInfo):
            raise ValueError("register: HSDP (2-D mesh, replicate + shard) is not supported; "
                             "use a 1-D mesh")
        if isinstance(pg._reduce_scatter_comm, _FSDP2Comm):
            raise RuntimeError(f"register: TAGC is already registered on {name or '<root>'!r}")
        mods.append((name, m, pg))
    if not mods:
        raise TypeError("register: the model has no fully_shard-ed module with parameters")
    group = mods[0][2].mesh_info.shard_process_group
    state.world_size = dist.get_world_size(group)
    state.rank = dist.get_rank(group)
    for index, (name, m, pg) in enumerate(mods):
        infos = [(fp._module_info.module, fp._module_info.param_name,
                  getattr(fp._module_info.module, fp._module_info.param_name),
                  int(fp._orig_size.numel())) for fp in pg.fsdp_params]
        total, sel = _unit_params(cfg, names, infos)
        factor = pg.gradient_divide_factor
        divisor = float(factor) if factor is not None else float(state.world_size)
        # foreach_reduce pads every parameter's dim 0 to a multiple of N and
        # reduces only parameters with a gradient: frozen ones never have one
        flat = state.world_size * sum(int(fp.padded_sharded_param_size.numel())
                                      for fp in pg.fsdp_params
                                      if fp.sharded_param.requires_grad)
        unit = _Unit(state, _clean_name(name) or "<root>", index, int(total), flat, sel,
                     compressed=sel > 0 and 2 * sel >= total,
                     group=pg.mesh_info.shard_process_group, pre=1.0, post=divisor,
                     device=pg.device)
        state.units.append(unit)
    _check_agreement(state, group)
    for (name, m, pg), unit in zip(mods, state.units):
        m.set_custom_reduce_scatter(_FSDP2Comm(unit))
        # The comm receives the plain SUM and does the averaging itself.
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    _log_units(state)
    return state


def _check_agreement(state: TAGCState, group: Any) -> None:
    """Every rank must hold the same config and unit layout; raise on all ranks if not."""
    mine = {"config": state.cfg.to_dict(), "world_size": state.world_size,
            "units": [(u.name, u.numel, u.flat_numel, u.compressed) for u in state.units]}
    gathered: List[Any] = [None] * state.world_size
    dist.all_gather_object(gathered, mine, group=group)
    bad = [r for r, g in enumerate(gathered) if g != gathered[0]]
    if bad:
        diff = []
        for r in bad:
            g = gathered[r]
            keys = [k for k in g["config"] if g["config"].get(k) != gathered[0]["config"].get(k)]
            diff.append(f"rank {r}: config fields {keys}"
                        + ("" if g["units"] == gathered[0]["units"] else ", unit layout"))
        raise ValueError("register: TAGC config or FSDP unit layout differs between ranks "
                         f"(compared with rank 0): {'; '.join(diff)}")


def _log_units(state: TAGCState) -> None:
    for u in state.units:
        if u.compressed and u.selected_numel < u.numel:
            logger.info("TAGC unit %r: %d of %d elements selected; the whole unit is "
                        "compressed (use fsdp1_auto_wrap_policy/shard_model to separate)",
                        u.name, u.selected_numel, u.numel)
    logger.info("TAGC registered (%s, mode=%s): %d units, %d compressed", state.kind,
                state.cfg.mode, len(state.units), sum(u.compressed for u in state.units))


def register(model: nn.Module, cfg: TAGCConfig) -> TAGCState:
    """Make an FSDP model's gradient reduce-scatter use TAGC.

    Args:
        model: an FSDP1 root (``FullyShardedDataParallel``) or an FSDP2 model
            (``fully_shard``-ed root or containing ``fully_shard``-ed modules).
            Register before the first backward, once.
        cfg: the config; must be identical on every rank (checked).
    Returns:
        the :class:`TAGCState` (stats, checkpoints).
    Raises:
        TypeError: not an FSDP model, or ``cfg`` not a TAGCConfig.
        ValueError: unsupported sharding strategy, configs differ between ranks.
        RuntimeError: registered twice.
    """
    if not isinstance(cfg, TAGCConfig):
        raise TypeError(f"register: cfg must be a TAGCConfig, got {type(cfg).__name__}")
    if cfg.mode != "dense":
        _require_codec()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("register: torch.distributed is not initialized")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        return _register_fsdp1(model, cfg)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()  # type: ignore[assignment]
    if FSDPModule and any(isinstance(m, FSDPModule) for m in model.modules()):
        return _register_fsdp2(model, cfg)
    if any(isinstance(m, FSDP) for m in model.modules()):
        raise TypeError("register: pass the root FullyShardedDataParallel module")
    raise TypeError(f"register: {type(model).__name__} is not an FSDP model (wrap it with "
                    "FullyShardedDataParallel or torch.distributed.fsdp.fully_shard first)")
