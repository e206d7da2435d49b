"""TAGC: Transformer-Aware Gradient Compression for stock PyTorch FSDP.

One call turns an FSDP model's gradient reduce-scatter into a compressed
exchange; no patch to torch and no per-step call::

    import tagc_hook as tagc
    cfg = tagc.TAGCConfig.from_yaml("configs/tagc-balanced.yaml")   # or TAGCConfig(...)
    state = tagc.register(model, cfg)   # FSDP1 root, or an FSDP2 model
    ...train as usual...
    state.stats()
    dcp.save({"model": ..., "optim": ..., "tagc": state}, checkpoint_id=path)  # or
    torch.save(state.state_dict(), f"tagc-rank{rank}.pt")

Design: ``docs/DESIGN.md``.  All codec work (selection, sparsification,
bitmaps, lanes, sketches, peeling, pair packing, block quantization) is done
by the C module ``_tagc``; the package ``tagc/`` behind this module moves
buffers between ranks and keeps per-unit state:

* ``tagc/config.py``      TAGCConfig: every knob, documented and validated
* ``tagc/presets.py``     the YAML presets shipped with the package, found by name
* ``tagc/selection.py``   which parameters are compressed; which modules get own units
* ``tagc/wrapping.py``    the wrapping helpers: fsdp1_auto_wrap_policy, shard_model
* ``tagc/state.py``       register() and TAGCState (stats, checkpoints)
* ``tagc/fsdp1.py``, ``tagc/fsdp2.py``  the FSDP glue (all torch internals)
* ``tagc/hsdp.py``        custom HSDP: the all-reduce between replicas, compressed
* ``tagc/overlap.py``     custom HSDP on the CPU: that all-reduce beside the backward
* ``tagc/local.py``       custom HSDP's local steps (DiLoCo): an outer step every H
* ``tagc/reducer.py``     UnitReducer: what FSDP holds per unit; one reduction
* ``tagc/bypass.py``      the timing-based bypass (``bypass_every``): compress or not
* ``tagc/memory.py``      what the feedback state keeps per rank: its layout and bytes
* ``tagc/transports.py``  the transports, one signature, a table by mode
* ``tagc/codec.py``       the handle on the C module ``_tagc`` (its only importer)
* ``tagc/gather.py``      quantized parameter all-gathers (FSDP2, ``gather``)
* ``tagc/pipeline.py``    pipeline parallelism: coded stage boundaries
  (``pipeline_stage``, ``PipelineConfig``; int8/int4 blocks or Protocol Models' subspace)
* ``tagc/checkpoint.py``  the state in checkpoints; ``tagc/positions.py`` where each
  feedback element belongs (by parameter name), so another shape can map it
* ``tagc/comm.py``, ``tagc/device.py``, ``tagc/stats.py``
* ``tagc/teardown.py``    the exit drain: gloo's workers done with Python before exit

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

from tagc.config import MODES, PAPER_THETA, QUANT_BITS, QUANT_FORMATS, TAGCConfig
from tagc.pipeline import PipelineConfig, pipeline_stage
from tagc.selection import select_parameter
from tagc.state import TAGCState, register
from tagc.wrapping import fsdp1_auto_wrap_policy, shard_model

__all__ = [
    "TAGCConfig",
    "TAGCState",
    "register",
    "fsdp1_auto_wrap_policy",
    "shard_model",
    "select_parameter",
    "PipelineConfig",
    "pipeline_stage",
    "MODES",
    "QUANT_FORMATS",
    "QUANT_BITS",
    "PAPER_THETA",
]
