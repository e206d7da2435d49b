"""FSDP2 glue: every use of ``fully_shard`` internals is here.

``FSDPModule.set_custom_reduce_scatter(comm)`` takes one comm object per module, i.e.
per unit (the identity error feedback needs).  FSDP2 calls it synchronously on its
reduce-scatter stream with ``(output, input, group, op)``; ``input.view(N, -1)`` row r
goes to rank r and holds chunk r of every parameter (dim 0 padded with zeros).  TAGC
asks for the plain SUM (``set_force_sum_reduction_for_comms``) and FSDP's own divide
to be a no-op (:func:`sum_reductions`), and averages itself.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import TAGCConfig
from . import positions
from .device import CodecStreams
from .overlap import in_backward
from .reducer import UnitReducer
from .selection import module_names, unit_spec

logger = logging.getLogger(__name__)

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _RSBase
except ImportError:  # pragma: no cover - older torch without custom comms
    _RSBase = object  # type: ignore[assignment,misc]

# The oldest torch the package supports: every FSDPModule method below exists there and
# FSDP2 skips the reduce-scatter with one rank (2.10; 2.9 would call the comm), read from
# each release's sources (docs/USAGE.md "torch versions").  setup.py states it too.
TORCH_FLOOR = "2.10"
# FSDPModule methods the glue calls -> (the first torch that has them, what needs them)
TORCH_NEEDS = {
    "set_custom_reduce_scatter": ("2.9", "TAGC's FSDP2 gradient reduce-scatter"),
    "set_force_sum_reduction_for_comms": ("2.8", "FSDP2's plain SUM, which TAGC averages"),
    "set_gradient_divide_factor": ("2.8", "FSDP2's plain SUM, which TAGC averages"),
    "set_all_reduce_hook": ("2.7", "TAGC's HSDP all-reduce between replicas"),
    "set_custom_all_gather": ("2.9", "quantized parameter all-gathers (gather: int8/int4)"),
}


def check_torch(hsdp: bool, gather: bool) -> None:
    """Refuse a torch that lacks an FSDP2 method the install would call, naming the
    release that has it (instead of an AttributeError half way through the install).

    Args:
        hsdp: TAGC's HSDP route (the all-reduce hook instead of the reduce-scatter).
        gather: quantized parameter all-gathers.
    Raises:
        RuntimeError: a method is missing.
    """
    from torch.distributed.fsdp import FSDPModule

    names = ["set_force_sum_reduction_for_comms", "set_gradient_divide_factor",
             "set_all_reduce_hook" if hsdp else "set_custom_reduce_scatter"]
    if gather:
        names.append("set_custom_all_gather")
    for name in names:
        if not hasattr(FSDPModule, name):
            version, what = TORCH_NEEDS[name]
            raise RuntimeError(f"register: {what} needs torch >= {version} "
                               f"(FSDPModule.{name}); this is torch {torch.__version__} "
                               f"(TAGC supports torch >= {TORCH_FLOOR})")


def param_groups(mod: nn.Module) -> List[Any]:
    """The FSDP2 module's parameter groups: ``_fsdp_param_groups`` since torch 2.12 (per
    parameter meshes), the single ``_fsdp_param_group`` (or None) before."""
    state = mod._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


class ReduceScatterComm(_RSBase):  # type: ignore[misc,valid-type]
    """FSDP2 custom reduce-scatter: one object per FSDPModule, i.e. per unit.

    Args:
        reducer: the unit's reducer.
        params: the unit's ``FSDPParam``s (what :func:`deferrable` checks).
        overlap: the model's worker (``fsdp_overlap`` on the CPU), None to run on the
            calling thread.
        order: the forward order to close at the first backward (with ``overlap``).
    """

    def __init__(self, reducer: UnitReducer, params: List[Any],
                 overlap: Optional[Any] = None,
                 order: Optional["ForwardOrder"] = None) -> None:
        self.reducer, self.params, self.overlap, self.order = reducer, params, overlap, order

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, op: Any = None, async_op: bool = False) -> None:
        if op is not None and op != dist.ReduceOp.SUM:
            raise RuntimeError(f"TAGC: FSDP2 asked for reduce op {op}; register() forces "
                               "SUM (set_force_sum_reduction_for_comms) and owns the averaging")
        self.reducer.group = group
        ov = self.overlap
        if ov is None or output_tensor.is_cuda:
            self.reducer.reduce(input_tensor, output_tensor)
            return None
        if self.order is not None:
            self.order.close()

        def job() -> None:
            self.reducer.reduce(input_tensor, output_tensor)

        if deferrable(output_tensor, self.params):
            ov.submit(job)
        else:  # FSDP reads the output at once: on the worker, in order, and wait
            ov.run(job, "FSDP2 reduce-scatter").wait()
        return None


class ForwardOrder:
    """The order FSDP2 units gather in the forward, and the forward prefetch it sets.

    FSDP2 prefetches the next unit's all-gather in the backward by itself, but in the
    forward only where told (``set_modules_to_forward_prefetch``).  With the gathers on
    the worker (``fsdp_overlap``), a unit prefetching the next one lets that one's
    bytes travel while this one computes.  The order is recorded from the first
    forward's gathers (the same model runs the same forward on every rank, so every
    rank records the same order and issues the same collectives) and applied when the
    first backward begins, each unit then prefetching its successor: one unit's
    gathered parameters more held at a time, as FSDP on a GPU holds.  A model whose
    units already prefetch (the user's ``set_modules_to_forward_prefetch``) is left
    alone.

    Args:
        mods: the FSDP2 units, index for index with the gather comms that call
            :meth:`seen`.
    """

    def __init__(self, mods: List[nn.Module]) -> None:
        self.mods = mods
        self.order: List[int] = []
        self.closed = False

    def seen(self, unit: int) -> None:
        """A gather of ``unit`` outside a backward (a forward)."""
        if not self.closed and unit not in self.order:
            self.order.append(unit)

    def close(self) -> None:
        """Set each recorded unit to prefetch the next (once; inside the first
        backward, when the forward has run)."""
        if self.closed:
            return
        self.closed = True
        if any(m._get_fsdp_state()._states_to_forward_prefetch for m in self.mods):
            logger.info("TAGC: the model sets its own forward prefetch; kept")
            return
        units = [self.mods[i] for i in self.order]
        for a, b in zip(units, units[1:]):
            a.set_modules_to_forward_prefetch([b])


def _param_groups(model: nn.Module) -> List[Tuple[str, nn.Module, Any]]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    mods = []
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        groups = param_groups(m)
        if not groups:
            continue
        if len(groups) > 1:
            raise ValueError(f"register: FSDP2 module {name!r} has several parameter groups "
                             "(per-parameter meshes); TAGC needs one per module")
        pg = groups[0]
        if isinstance(pg.mesh_info, HSDPMeshInfo):
            raise ValueError("register: native HSDP (a 2-D mesh given to fully_shard) "
                             "all-reduces inside FSDP, where TAGC cannot hook; shard with "
                             "tagc.shard_model(model, cfg, mesh=mesh) instead (TAGC's custom "
                             "HSDP compresses the all-reduce between the replicas)")
        if isinstance(pg._reduce_scatter_comm, ReduceScatterComm):
            raise RuntimeError(f"register: TAGC is already registered on {name or '<root>'!r}")
        mods.append((name, m, pg))
    if not mods:
        raise TypeError("register: the model has no fully_shard-ed module with parameters")
    return mods


def reducers(model: nn.Module, cfg: TAGCConfig, streams: CodecStreams
             ) -> Tuple[List[UnitReducer], List[nn.Module], Any]:
    """One reducer per FSDP2 module with parameters, the module, and the shard group.

    Raises:
        ValueError: HSDP meshes or several parameter groups per module.
        RuntimeError: already registered.
        TypeError: nothing is sharded.
    """
    mods = _param_groups(model)
    names = module_names(model)
    group = mods[0][2].mesh_info.shard_process_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out: List[UnitReducer] = []
    for index, (name, m, pg) in enumerate(mods):
        infos = [(fp._module_info.module, fp._module_info.param_name,
                  getattr(fp._module_info.module, fp._module_info.param_name),
                  int(fp._orig_size.numel())) for fp in pg.fsdp_params]
        factor = pg.gradient_divide_factor
        divisor = float(factor) if factor is not None else float(world)
        # foreach_reduce pads every parameter's dim 0 to a multiple of N and
        # reduces only parameters with a gradient: frozen ones never have one
        flat = world * sum(int(fp.padded_sharded_param_size.numel())
                           for fp in pg.fsdp_params if fp.sharded_param.requires_grad)
        spec = unit_spec(cfg, names, name, index, infos, flat, pg.device)
        out.append(UnitReducer(cfg, spec, pg.mesh_info.shard_process_group, rank, world,
                               1.0, divisor, streams))
        out[-1].layout = positions.fsdp2_layout(names, pg.fsdp_params, world)
    return out, [m for _, m, _ in mods], group


def shard_mesh(mods: List[nn.Module]) -> Any:
    """The 1-D device mesh the FSDP2 units ``mods`` (:func:`reducers`' modules, whose
    parameter groups it has checked) are sharded over."""
    return param_groups(mods[0])[0].mesh_info.mesh


def unit_params(mod: nn.Module) -> List[Any]:
    """The ``FSDPParam``s of an FSDP2 unit :func:`reducers` accepted (one parameter
    group per module)."""
    return list(param_groups(mod)[0].fsdp_params)


def output_left_alone(params: List[Any], dtype: torch.dtype) -> bool:
    """Whether FSDP2 (torch 2.13, ``foreach_reduce``) only views a unit's reduce output
    as the parameters' ``.grad`` after the reduce hooks, reading nothing: no parameter
    accumulates into an existing ``.grad``, casts from the reduce ``dtype``, offloads
    to the host, or has a post-accumulate-grad hook (each reads the output at once).

    Args:
        params: the unit's ``FSDPParam``s (:func:`unit_params`).
        dtype: the reduce output's dtype.
    Returns:
        the answer.
    """
    for fp in params:
        p = fp.sharded_param
        if p.grad is not None or getattr(fp, "offload_to_cpu", False):
            return False
        if getattr(fp, "orig_dtype", dtype) != dtype:
            return False
        if getattr(p, "_post_accumulate_grad_hooks", None):
            return False
    return True


def deferrable(t: torch.Tensor, params: Iterable[Any]) -> bool:
    """Whether FSDP leaves a comm's output alone until the backward ends
    (tagc/overlap.py).

    Args:
        t: the reduce-scatter's output (FULL_SHARD) or the all-reduce hook's tensor
            (HSDP).
        params: the unit's ``FSDPParam``s.
    Returns:
        True when the exchange into ``t`` may finish after the comm returns: a CPU
        tensor inside a backward, and no parameter of the unit accumulates into an
        existing ``.grad``, casts to another dtype, offloads, or has a
        post-accumulate-grad hook (each of which reads ``t`` right after the hook).
    """
    if t.is_cuda or not in_backward():
        return False
    return output_left_alone(list(params), t.dtype)


def sum_reductions(mod: nn.Module, shards: int) -> None:
    """Make FSDP2 sum a unit's gradients and divide by nothing: TAGC's hook averages.

    With several ranks in the unit's group a divide factor of 1 is a no-op.  With one,
    no factor at all: FSDP2 (torch 2.13 ``foreach_reduce``) then skips the
    reduce-scatter and copies its input plainly, and its post-divide is by the group's
    size, 1; any factor, even 1, makes it copy ``input / factor`` into a fresh
    unit-sized tensor every call (page faults and one more pass, the same values).
    ``set_gradient_divide_factor`` has no way back to the default, None, so that is
    set on the parameter group.

    Args:
        mod: the FSDP2 unit.
        shards: the size of the group it is sharded over.
    """
    # both exist from torch 2.8 (check_torch refuses older): skipping them would leave
    # FSDP dividing what TAGC divides again
    mod.set_force_sum_reduction_for_comms(True)
    if shards > 1:
        mod.set_gradient_divide_factor(1.0)
        return
    for pg in param_groups(mod):
        pg.gradient_divide_factor = None


def install(model: nn.Module, reducers_: List[UnitReducer], mods: List[nn.Module],
            overlap: Optional[Any] = None, order: Optional[ForwardOrder] = None) -> None:
    """Give each module its comm; the comm receives the plain SUM and averages itself.

    Args:
        model: the model (unused; the FSDP1 glue's signature).
        reducers_: one reducer per unit.
        mods: the units.
        overlap: the worker the comms hand their exchanges to (``fsdp_overlap``).
        order: the forward order the comms close at the first backward.
    """
    for m, r in zip(mods, reducers_):
        m.set_custom_reduce_scatter(ReduceScatterComm(r, unit_params(m), overlap, order))
        sum_reductions(m, r.world)
