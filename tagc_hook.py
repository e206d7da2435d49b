"""TAGC: Transformer-Aware Gradient Compression for stock PyTorch FSDP.

The public face: everything a user calls is importable from here.  One call turns an
FSDP model's gradient reduce-scatter (and, with ``tagc-full``, its parameter
all-gathers) into a compressed exchange; no patch to torch and no per-step call::

    import tagc_hook as tagc
    cfg = tagc.TAGCConfig.preset("full")       # FSDP2; FSDP1: TAGCConfig() (tagc-balanced)
    model = tagc.shard_model(model, cfg)       # FSDP2 (FSDP1: tagc.fsdp1_auto_wrap_policy)
    state = tagc.register(model, cfg)          # once, on every rank, before the backward
    ...train as usual...
    state.stats()                              # bytes per collective against plain FSDP
    dcp.save({"model": ..., "optim": ..., "tagc": state}, checkpoint_id=path)
    state.load_dcp(path)                       # or dcp.load(...) with the same mapping

What it exports: :class:`TAGCConfig` (the knobs; ``presets`` finds the shipped YAML
files by name), :func:`register` and :class:`TAGCState` (``stats()``, ``memory()``,
``exact_gathers()``, ``state_dict()``/``load_state_dict()``, ``check_dcp()``/``load_dcp()``
for checkpoints), the wrapping helpers :func:`shard_model` and
:func:`fsdp1_auto_wrap_policy`, the pipeline stage builder :func:`pipeline_stage` with
:class:`PipelineConfig`, and ``teardown`` (``teardown.install()``: the exit drain that
``register()`` installs, for a plain gloo program).  The package ``tagc/`` behind this
module is the implementation; the docstring of ``tagc/__init__.py`` is the module map.  Design:
``docs/DESIGN.md``; every knob: ``docs/USAGE.md``.

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
  the sum of the raw gradients over ranks and steps (exactly so with an fp32
  residual; a residual kept as codes, ``residual_code``, drops what its
  coding rounds away).
* Non-finite gradients: before compressing, ranks agree (one small
  all-reduce per compressed call: 4 bytes, 32 with EF21's damping or the
  guard, which share it) whether any rank's unit gradient holds NaN/Inf.  If
  one does, the feedback state is left untouched and the inf/nan reaches the
  reduced gradient, so GradScaler sees it, by a path that differs per
  device.  CPU: every rank takes the plain reduce-scatter
  (custom HSDP: the plain all-reduce) that call.  CUDA: the flag never
  reaches the host, so the call still compresses: every rank poisons every
  shard with a NaN (``tagc.device.poison_nonfinite``), which the CUDA
  encoders answer by leaving the residual untouched and sending NaN to every
  owner.
* CUDA: codec work runs on a side stream per device, ordered against FSDP's
  reduce-scatter stream, with no host synchronisation (timeline in
  ``UnitReducer.reduce``); counters accumulate on the device and are read by
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

from tagc import __version__, presets, teardown
from tagc.config import MODES, PAPER_THETA, QUANT_BITS, QUANT_FORMATS, TAGCConfig
from tagc.ft import FTAllReduce, FTLocalSteps, FTManager
from tagc.ft import register as register_ft
from tagc.pipeline import PipelineConfig, pipeline_stage
from tagc.selection import select_parameter
from tagc.state import TAGCState, register
from tagc.wrapping import fsdp1_auto_wrap_policy, shard_model

__all__ = [
    "__version__",
    "TAGCConfig",
    "TAGCState",
    "register",
    "fsdp1_auto_wrap_policy",
    "shard_model",
    "select_parameter",
    "PipelineConfig",
    "pipeline_stage",
    "presets",
    "teardown",
    "MODES",
    "QUANT_FORMATS",
    "QUANT_BITS",
    "PAPER_THETA",
    "FTAllReduce",
    "FTManager",
    "FTLocalSteps",
    "register_ft",
]
