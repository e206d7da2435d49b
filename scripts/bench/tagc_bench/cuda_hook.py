"""TAGC's hook on CUDA end to end in one process: what one rank can show (issue 39 1d).

One NCCL rank, a small GPT-2 (``tagc.train.model.GPT``) sharded by ``tagc.shard_model`` and
registered by ``tagc.register`` with each recommended preset (tagc-balanced, tagc-full,
tagc-lean).  FSDP2 never reduces on one rank, so the comm objects ``register`` installed
are called directly, as FSDP2 calls them on more ranks, and their results are compared
with a reference: the same reducer class built on the CPU (the C codec) over a loopback
comm, fed the same inputs.  The checks, per preset:

* ``reduce-scatter``: every unit's custom reduce-scatter (``FSDPParamGroup.
  _reduce_scatter_comm``) called on a side stream for three steps; the outputs FSDP would
  get, against the CPU reference.  With one rank the quant transport adds the own shard
  exactly: this runs the hook's device logic (vote, EF21, damping) but no codec kernel;
* ``reduce-scatter, loopback rank``: the stand-in for a second rank.  Each unit's reducer
  rebuilt for two ranks (rank 0 of 2) on a comm whose peer is this rank itself (the
  message rank 0 encodes for shard 1 comes back as rank 1's message for shard 0): the
  codec kernels run inside the hook, with feedback, on the codec stream;
* ``non-finite, loopback rank``: an Inf in one gradient; the output must carry it, the
  feedback state must not change (CUDA: the poisoned shards; CPU: the plain path);
* ``all-gather`` (tagc-full): every unit's quantized parameter all-gather, against the
  C op's wq_encode + wq_decode of the same shard (bit for bit);
* ``HSDP all-reduce``: the model sharded over a (1, 1) (replicate, shard) mesh: FSDP
  calls TAGC's all-reduce hook inside a real backward even on one rank, and the hook
  runs the codec (encode with feedback, an NCCL all-gather of one rank, decode).  Every
  call of a step is recorded and replayed on the CPU reference;
* ``training step``: one FSDP2 step; gradients against the unsharded model's;
* ``no host sync`` (CUDA): ``torch.cuda.set_sync_debug_mode("error")`` around every
  call above after a warm-up, the HSDP backward's hook calls included;
* ``stream order`` (CUDA, ``torch.profiler``): a kernel on the caller's stream, the call,
  a kernel after it: the hook's kernels run on another stream, after the first kernel
  and before the second, and no synchronizing CUDA runtime call is made in between.

What one process cannot run: two ranks on one GPU (NCCL refuses two ranks per device;
gloo has no CUDA send/recv), so the batched isend/irecv between ranks, the owners' sums
of several ranks' codes and the overlap with a second rank's traffic stay unrun.

The values compared: ``bit-equal`` says whether every output had the C reference's bits;
a check passes when the relative L2 error is below 1e-3 (EF21's damping factor comes from
dot products, whose summation order differs between the GPU and the CPU, so a few int4
codes may round the other way).

Usage::

    python3 scripts/bench/tagc_bench/cuda_hook.py --json hook.json  # on a GPU
    # the CPU path: a check of this harness only
    python3 scripts/bench/tagc_bench/cuda_hook.py --device cpu --json hook.json
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

import tagc.reducer
from tagc import fsdp2
from tagc.codec import _tagc
from tagc.comm import Comm
from tagc.config import TAGCConfig
from tagc.device import CodecStreams
from tagc.hsdp import ReplicaReducer
from tagc.reducer import UnitReducer
from tagc.selection import UnitSpec
from tagc.wrapping import shard_model

if not __package__:  # run as a file: the folder holding tagc_bench onto the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tagc_bench.cuda_ops import require_device  # noqa: E402 - after the path

PRESETS = ("balanced", "full", "lean")
REL_TOL = 1e-3
# the codec's kernels (cuda/*.cu): how the profiler's trace names them
CODEC_KERNEL = re.compile(r"(quant|wq|sparsify|select|peel|sketch|pairs|sparse|lanes|"
                          r"bitmap_or|popcount|estimate|tagc_tile)\w*_kernel")
# CUDA runtime/driver calls that make the host wait for the device (synchronous copies
# and the *Synchronize calls; queries do not wait)
SYNC_CALL = re.compile(r"^(cuda|cu)(Device|Ctx|Stream|Event)Synchronize|"
                       r"^cudaMemcpy(2D)?(To|From)?(Symbol)?$|^cuMemcpy(DtoH|HtoD|DtoD)?(_v2)?$")


# ----------------------------------------------------------------------------- results
class Checks:
    """The results: one entry per (preset, check), each ok, failed or skipped."""

    def __init__(self) -> None:
        self.rows: List[Dict[str, Any]] = []

    def add(self, preset: str, check: str, status: str, detail: str = "",
            **metrics: Any) -> None:
        self.rows.append({"preset": preset, "check": check, "status": status,
                          "detail": detail, "metrics": metrics})
        print(f"[{status}] {preset} / {check}: {detail}", flush=True)

    @contextlib.contextmanager
    def run(self, preset: str, check: str) -> Iterator[Dict[str, Any]]:
        """A check's body: it fills the yielded dict (``detail``, ``ok``, ``skip``, metrics);
        an exception fails it with the traceback's tail."""
        out: Dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            yield out
        except Exception as exc:  # noqa: BLE001 - a failed check must not end the others
            tb = traceback.format_exc().strip().splitlines()
            self.add(preset, check, "failed", f"{type(exc).__name__}: {exc}"[:500],
                     traceback="\n".join(tb[-12:]), seconds=time.perf_counter() - t0)
            return
        skip = out.pop("skip", None)
        if skip:
            self.add(preset, check, "skipped", skip)
            return
        ok = out.pop("ok", True)
        detail = out.pop("detail", "")
        self.add(preset, check, "ok" if ok else "failed", detail,
                 seconds=time.perf_counter() - t0, **out)


def compare(got: List[torch.Tensor], want: List[torch.Tensor]) -> Dict[str, Any]:
    """Bits, relative L2 error and largest difference of outputs against references."""
    bits, num, den, worst = True, 0.0, 0.0, 0.0
    for g, w in zip(got, want):
        g, w = g.detach().float().cpu().reshape(-1), w.detach().float().cpu().reshape(-1)
        bits = bits and g.shape == w.shape and bool(torch.equal(g.view(torch.int32),
                                                                w.view(torch.int32)))
        d = (g.double() - w.double())
        num += float((d * d).sum())
        den += float((w.double() * w.double()).sum())
        worst = max(worst, float(d.abs().max()) if d.numel() else 0.0)
    rel = math.sqrt(num / den) if den > 0 else math.sqrt(num)
    return {"bit_equal": bits, "rel_l2": rel, "max_abs_diff": worst}


def verdict(out: Dict[str, Any], cmp: Dict[str, Any], what: str) -> None:
    """Fill a check's result from a comparison."""
    out.update(cmp)
    out["ok"] = bool(math.isfinite(cmp["rel_l2"]) and cmp["rel_l2"] <= REL_TOL)
    out["detail"] = (f"{what}: {'bit-equal' if cmp['bit_equal'] else 'not bit-equal'} to the "
                     f"C reference, rel L2 {cmp['rel_l2']:.2e}, max abs diff "
                     f"{cmp['max_abs_diff']:.2e}")


# ----------------------------------------------------------------------------- loopback
class LoopbackComm(Comm):
    """The collectives of rank ``rank`` of ``world`` ranks that hold the same data as this
    one, in one process: a sum over the ranks is ``world`` times this rank's tensor, and
    the message a peer sends this rank is the one this rank sends that peer.  No process
    group is used."""

    def all_reduce(self, t: torch.Tensor, async_op: bool = False,
                   control: bool = False) -> Any:
        nb = t.numel() * t.element_size()
        self.stats.record("all_reduce", nb, 2.0 * (self.world - 1) / self.world * nb, control)
        if self.world != 1:
            t.mul_(self.world)
        return None

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        nb = inp.numel() * inp.element_size()
        self.stats.record("all_gather_single", nb, (self.world - 1) * nb)
        out.view(self.world, -1).copy_(inp.reshape(1, -1).expand(self.world, -1))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        nb = inp.numel() * inp.element_size()
        self.stats.record("reduce_scatter_single", nb, (self.world - 1) / self.world * nb)
        out.copy_(inp.view(self.world, -1)[self.rank] * self.world)

    def post_recvs(self, recv: torch.Tensor) -> List[Any]:
        return []

    def post_send(self, works: List[Any], buf: torch.Tensor, recv: torch.Tensor,
                  r: int) -> None:
        nb = buf[r].numel() * buf[r].element_size()
        self.stats.record("isend", nb, nb)
        recv[(2 * self.rank - r) % self.world].copy_(buf[r])

    @staticmethod
    def wait(works: List[Any]) -> None:
        return None


@contextlib.contextmanager
def loopback() -> Iterator[None]:
    """Reducers called inside use :class:`LoopbackComm` (``tagc.reducer.Comm``)."""
    saved = tagc.reducer.Comm
    tagc.reducer.Comm = LoopbackComm  # type: ignore[misc]
    try:
        yield
    finally:
        tagc.reducer.Comm = saved  # type: ignore[misc]


def unit_reducers(cfg: TAGCConfig, sizes: Sequence[int], device: torch.device,
                  world: int, *, group: Any = None, rank: int = 0,
                  unit_path: Optional[bool] = None,
                  names: Optional[Sequence[str]] = None) -> List[UnitReducer]:
    """The hook's reducers of an FSDP2 model's units, outside FSDP: unit i has ``sizes[i]``
    values (FSDP's padded reduce-scatter input, ``world`` whole shards), gradients summed
    and divided by ``world`` as FSDP2 asks, one codec stream pair shared by all.

    Args:
        cfg: the TAGC config (a preset's).
        sizes: each unit's reduce-scatter input length.
        device: where the reducers' state and kernels live.
        world: ranks.
        group: the process group (None: a loopback or one-rank comm).
        rank: this rank.
        unit_path: force the unit path on (True) or off (False); None: the reducer's rule.
        names: the units' names (default ``u0``, ``u1``, ...).
    Returns:
        one reducer per unit, in order.
    """
    streams = CodecStreams()
    out = []
    for i, n in enumerate(sizes):
        r = UnitReducer(cfg, UnitSpec(names[i] if names else f"u{i}", i, n, n, n, device),
                        group, rank, world, 1.0, float(world), streams)
        if unit_path is not None:
            r.UNIT_PATH = unit_path
        out.append(r)
    return out


def rebuild(r: UnitReducer, device: torch.device, world: int) -> UnitReducer:
    """``r``'s class with ``r``'s config and unit on ``device`` for ``world`` ranks (rank 0),
    no process group: the CPU reference of a CUDA reducer, or a reducer for the loopback
    stand-in of more ranks.  Its feedback state starts empty, as ``r``'s did."""
    spec = dataclasses.replace(r.spec, device=device,
                               flat_numel=r.flat_numel // r.world * world
                               if not isinstance(r, ReplicaReducer) else r.flat_numel)
    if isinstance(r, ReplicaReducer):
        twin: UnitReducer = type(r)(r.cfg, spec, None, 0, world, CodecStreams(), r.shard_numel)
        twin.divide = r.divide
        return twin
    post = r.post if world == r.world else float(world)
    return UnitReducer(r.cfg, spec, None, 0, world, r.pre, post, CodecStreams())


# ----------------------------------------------------------------------------- setup
def small_gpt(device: torch.device, seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2 whose units are big enough for the presets' min_numel (65536)."""
    from tagc.train.model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, vocab_size=4096,
                         block_size=64)).to(device)


def fsdp_groups(model: nn.Module) -> List[Any]:
    """Every FSDP2 parameter group of the model, in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [pg for m in model.modules() if isinstance(m, FSDPModule)
            for pg in fsdp2.param_groups(m)]


def missing_api(needs: List[str]) -> Optional[str]:
    """Why this torch cannot run a check (the first missing API), or None."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no FSDP2 ({exc})"
    for name in needs:
        if name.startswith("cuda."):
            if not hasattr(torch.cuda, name[5:]):
                return f"torch {torch.__version__} has no torch.{name}"
        elif not hasattr(FSDPModule, name):
            return f"torch {torch.__version__} has no FSDPModule.{name}"
    return None


def register(model: nn.Module, cfg: TAGCConfig, mesh: Any = None) -> Tuple[Any, Optional[str]]:
    """``tagc.register``; (state, None), or (None, why) where this torch lacks a piece
    register() names (``register: ... needs torch >= ...``)."""
    from tagc.state import register as tagc_register

    try:
        return tagc_register(model, cfg, mesh=mesh), None
    except RuntimeError as exc:
        if "needs torch" in str(exc):
            return None, str(exc)
        raise


class Harness:
    """The device under test and how calls reach it.

    Args:
        device: ``cuda`` or ``cpu`` (the CPU path: a check of this harness only).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.sync_checks: List[Tuple[str, str, Optional[str]]] = []

    def rand(self, n: int, seed: int) -> torch.Tensor:
        """n normal values (generated on the CPU: the reference gets the same)."""
        return torch.randn(n, generator=torch.Generator().manual_seed(seed))

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """A stream like FSDP's reduce-scatter / all-gather streams: ordered after the
        current one, the current one ordered after it."""
        if not self.cuda:
            yield
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            yield
        torch.cuda.current_stream().wait_stream(s)

    @contextlib.contextmanager
    def no_sync(self, what: str) -> Iterator[None]:
        """``torch.cuda.set_sync_debug_mode("error")`` around the body (CUDA): a host
        synchronisation inside raises; the outcome is recorded for the ``no host sync``
        check (and the exception passed on)."""
        if not self.cuda or not hasattr(torch.cuda, "set_sync_debug_mode"):
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        except RuntimeError as exc:
            if "synchroniz" in str(exc).lower():
                self.sync_checks.append((what, "failed", str(exc).splitlines()[0][:300]))
            raise
        else:
            self.sync_checks.append((what, "ok", None))
        finally:
            torch.cuda.set_sync_debug_mode("default")


# ----------------------------------------------------------------------------- checks
def reduce_scatter_checks(h: Harness, checks: Checks, preset: str, cfg: TAGCConfig) -> None:
    """The FULL_SHARD registration: direct reduce-scatter calls, the loopback rank, the
    non-finite path, the all-gathers (tagc-full), a training step."""
    needs = ["set_custom_reduce_scatter"] + (["set_custom_all_gather"] if cfg.gather != "none"
                                             else [])
    why = missing_api(needs)
    model = shard_model(small_gpt(h.device), cfg) if why is None else None
    state, why = register(model, cfg) if why is None else (None, why)
    if state is None:
        for name in ("reduce-scatter", "reduce-scatter, loopback rank", "all-gather",
                     "training step"):
            checks.add(preset, name, "skipped", why or "")
        return
    comms = [(pg._reduce_scatter_comm, pg.mesh_info.shard_process_group)
             for pg in fsdp_groups(model)]
    cpu = torch.device("cpu")

    with checks.run(preset, "reduce-scatter") as out:
        got, want = [], []
        for ui, (comm, pg) in enumerate(comms):
            r = comm.reducer  # the unit's UnitReducer (tagc.fsdp2.ReduceScatterComm)
            ref = rebuild(r, cpu, 1)
            for step in range(3):
                g = h.rand(r.flat_numel, seed=1000 * ui + step)
                o = torch.full((r.flat_numel,), float("nan"), device=h.device)
                gd = g.to(h.device)
                ctx = h.no_sync(f"{preset}: reduce-scatter, unit {r.name!r}") if step == 2 \
                    else contextlib.nullcontext()
                with ctx, h.side_stream():
                    comm(output_tensor=o, input_tensor=gd, group=pg, op=dist.ReduceOp.SUM)
                ro = torch.full((r.flat_numel,), float("nan"))
                with loopback():
                    ref.reduce(g.clone(), ro)
                got.append(o)
                want.append(ro)
        verdict(out, compare(got, want), f"{len(comms)} units x 3 steps")
        st = state.stats()["total"]
        out["compressed_calls"] = st["compressed_calls"]
        if st["compressed_calls"] != 3 * sum(r.compressed for r in state.units):
            out["ok"] = False
            out["detail"] += f"; compressed_calls {st['compressed_calls']}"

    with checks.run(preset, "reduce-scatter, loopback rank") as out:
        got, want = [], []
        pairs = [(rebuild(r, h.device, 2), rebuild(r, cpu, 2)) for r in state.units
                 if r.compressed]
        for ui, (dev_r, ref) in enumerate(pairs):
            for step in range(3):
                g = h.rand(dev_r.flat_numel, seed=5000 + 100 * ui + step)
                s = dev_r.flat_numel // 2
                o = torch.empty(s, device=h.device)
                ro = torch.empty(s)
                gd = g.to(h.device)
                ctx = h.no_sync(f"{preset}: loopback reduce-scatter, unit {dev_r.name!r}") \
                    if step == 2 else contextlib.nullcontext()
                with loopback():
                    with ctx, h.side_stream():
                        dev_r.reduce(gd, o)
                    ref.reduce(g.clone(), ro)
                got.append(o)
                want.append(ro)
            for name, _, _ in dev_r.feedback_buffers():
                got.append(getattr(dev_r, name))
                want.append(getattr(ref, name))
        verdict(out, compare(got, want),
                f"{len(pairs)} units x 3 steps, 2 ranks (codec kernels in the hook), outputs "
                "and feedback state")
        h.loopback_pairs = pairs  # type: ignore[attr-defined]

    with checks.run(preset, "non-finite, loopback rank") as out:
        dev_r, ref = pairs[0]
        g = h.rand(dev_r.flat_numel, seed=77)
        g[dev_r.flat_numel // 4] = float("inf")
        before = [getattr(dev_r, n).detach().cpu().clone() for n, _, _ in
                  dev_r.feedback_buffers()]
        rbefore = [getattr(ref, n).clone() for n, _, _ in ref.feedback_buffers()]
        o = torch.zeros(dev_r.flat_numel // 2, device=h.device)
        ro = torch.zeros(dev_r.flat_numel // 2)
        with loopback():
            with h.side_stream():
                dev_r.reduce(g.to(h.device), o)
            ref.reduce(g.clone(), ro)
        kept = all(torch.equal(a, getattr(dev_r, n).detach().cpu()) for a, (n, _, _) in
                   zip(before, dev_r.feedback_buffers()))
        rkept = all(torch.equal(a, getattr(ref, n)) for a, (n, _, _) in
                    zip(rbefore, ref.feedback_buffers()))
        carried = not bool(torch.isfinite(o.cpu()).all())
        out["ok"] = kept and rkept and carried and not bool(torch.isfinite(ro).all())
        out["detail"] = (f"output non-finite: {carried} (reference: "
                         f"{not bool(torch.isfinite(ro).all())}); feedback state unchanged: "
                         f"{kept} (reference: {rkept})")

    with checks.run(preset, "all-gather") as out:
        if cfg.gather == "none":
            out["skip"] = f"tagc-{preset} gathers exactly (gather: none)"
        elif not state.gathers:
            out["ok"], out["detail"] = False, "register() installed no all-gather comm"
        else:
            got, want = [], []
            for gi, gc in enumerate(state.gathers):
                for step in range(2):  # the first call copies the segment table to the GPU
                    x = h.rand(gc.shard_numel, seed=900 + 10 * gi + step)
                    o = torch.full((gc.shard_numel,), float("nan"), device=h.device)
                    xd = x.to(h.device)
                    ctx = h.no_sync(f"{preset}: all-gather, unit {gc.name!r}") if step \
                        else contextlib.nullcontext()
                    with ctx, h.side_stream():
                        gc(output_tensor=o, input_tensor=xd, group=gc.group)
                    buf = torch.empty(_tagc.wq_bytes(gc.segments, cfg.gather,
                                                     cfg.gather_block), dtype=torch.uint8)
                    _tagc.wq_encode(buf, x, gc.segments, cfg.gather, cfg.gather_block)
                    ro = torch.empty(gc.shard_numel)
                    _tagc.wq_decode(ro, buf, gc.segments, cfg.gather, cfg.gather_block)
                    got.append(o)
                    want.append(ro)
            verdict(out, compare(got, want), f"{len(state.gathers)} units x 2 calls, "
                    f"{cfg.gather} codes")
            quantized = state.stats()["total"].get("gather_quantized_calls")
            out["gather_quantized_calls"] = quantized
            if quantized != len(got):
                out["ok"] = False
                out["detail"] += f"; gather_quantized_calls {quantized}"

    with checks.run(preset, "training step") as out:
        ref_model = small_gpt(h.device)
        fresh = shard_model(small_gpt(h.device), cfg)
        st2, why = register(fresh, cfg)
        if st2 is None:
            out["skip"] = why
        else:
            idx = torch.randint(4096, (4, 64), generator=torch.Generator().manual_seed(3))
            idx = idx.to(h.device)
            tgt = torch.roll(idx, -1, dims=1)
            with st2.exact_gathers():  # tagc-full: the weights the unsharded model has
                _, loss = fresh(idx, tgt)
                loss.backward()
            _, rloss = ref_model(idx, tgt)
            rloss.backward()
            got = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                   for p in fresh.parameters()]
            want = [p.grad for p in ref_model.parameters()]
            cmp = compare(got, want)
            out.update(cmp)
            out["ok"] = math.isfinite(loss.item()) and cmp["rel_l2"] <= 1e-5
            out["detail"] = (f"loss {loss.item():.4f} (unsharded {rloss.item():.4f}); "
                             f"gradients rel L2 {cmp['rel_l2']:.1e} against the unsharded "
                             "model (one rank: FSDP copies, TAGC's comm is not called)")
            if cfg.gather != "none":  # a step with the quantized gathers, as training runs
                _, qloss = fresh(idx, tgt)
                qloss.backward()
                quantized = st2.stats()["total"].get("gather_quantized_calls")
                out["ok"] = out["ok"] and math.isfinite(qloss.item())
                out["detail"] += (f"; a step outside exact_gathers(): loss {qloss.item():.4f}, "
                                  f"{quantized} quantized gathers"
                                  + (" (FSDP2 called no all-gather on one rank)"
                                     if not quantized else ""))


def hsdp_checks(h: Harness, checks: Checks, preset: str, cfg: TAGCConfig) -> None:
    """TAGC's HSDP route on a (1, 1) mesh: FSDP calls the all-reduce hook in a real
    backward; every call is recorded and replayed on the CPU reference."""
    why = missing_api(["set_all_reduce_hook"])
    state = None
    if why is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(h.device.type, (1, 1), mesh_dim_names=("replicate", "shard"))
        model = shard_model(small_gpt(h.device), cfg, mesh=mesh)
        state, why = register(model, cfg, mesh=mesh)
    if state is None:
        checks.add(preset, "HSDP all-reduce", "skipped", why or "")
        return
    calls: List[Tuple[int, torch.Tensor, torch.Tensor]] = []
    step = [0]
    for ui, r in enumerate(state.units):
        inner = r.hook

        def recorded(t: torch.Tensor, ui: int = ui, inner: Callable = inner) -> None:
            # copies on the stream FSDP calls the hook on, ordered around the hook's work
            before = t.detach().clone()
            ctx = h.no_sync(f"{preset}: HSDP all-reduce hook, unit {ui}") \
                if step[0] else contextlib.nullcontext()  # from the second backward on
            with ctx:
                inner(t)
            calls.append((ui, before, t.detach().clone()))

        r.hook = recorded  # Hook calls reducer.hook(t)
    with checks.run(preset, "HSDP all-reduce") as out:
        idx = torch.randint(4096, (4, 64), generator=torch.Generator().manual_seed(5))
        idx = idx.to(h.device)
        for step[0] in range(2):
            _, loss = model(idx, torch.roll(idx, -1, dims=1))
            loss.backward()
        from_fsdp = len(calls)
        st = state.stats()["total"]  # joins the codec streams
        # and each unit's hook called directly, as FSDP does on its all-reduce stream
        for ui, r in enumerate(state.units):
            for k in range(2):
                t = h.rand(r.shard_numel, seed=3000 + 10 * ui + k).to(h.device)
                with h.side_stream():
                    r.hook(t)
        refs = {ui: rebuild(r, torch.device("cpu"), r.world) for ui, r in enumerate(state.units)}
        got, want = [], []
        with loopback():
            for ui, before, after in calls:
                t = before.detach().cpu().clone()
                refs[ui].hook(t)
                got.append(after)
                want.append(t)
        verdict(out, compare(got, want), f"{from_fsdp} hook calls from FSDP's backward "
                f"(2 steps, {len(state.units)} units) and {len(calls) - from_fsdp} direct ones "
                f"(codec: encode with feedback, {'an NCCL' if h.cuda else 'a gloo'} all-gather "
                "of one rank, decode)")
        out["compressed_calls"] = st["compressed_calls"]
        out["calls_from_fsdp"] = from_fsdp
        if from_fsdp == 0:
            out["detail"] += (f"; FSDP (torch {torch.__version__}) did not call the hook with "
                              "one replica: the direct calls only")
    h.hsdp_state = state  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- stream order
def stream_order(call: Callable[[], None], marker: torch.Tensor, side: bool) -> Dict[str, Any]:
    """Profile a marker kernel, ``call()``, a marker kernel, on the current stream R, and
    read the trace (:func:`read_trace`).

    Args:
        call: enqueues the hook's work.
        marker: a CUDA tensor for the two marker kernels.
        side: whether the hook's kernels must run off R (:func:`read_trace`).
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        marker.mul_(1.0)
        call()
        marker.add_(0.0)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return read_trace(json.load(f)["traceEvents"], side)


def read_trace(events: List[Dict[str, Any]], side: bool) -> Dict[str, Any]:
    """What a profiler trace of marker, call, marker (:func:`stream_order`) shows.

    The first kernel is the earlier marker, on the caller's stream R; the last kernel on
    R is the later marker; every kernel between them is the call's.  The call passes when
    its kernels (codec kernels among them) all started after the earlier marker ended and
    ended before the later one started (the codec stream waited for R, R for the codec
    stream), ran off R when ``side`` (the hook's codec stream, NCCL's), and this thread made
    no synchronizing CUDA call between the markers' launches.

    Args:
        events: the chrome trace's ``traceEvents``.
        side: whether the call's kernels must all run on other streams than R.
    Returns:
        the findings with ``ok`` (None: the trace holds no kernels) and ``detail``.
    """
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if len(kernels) < 2:
        return {"ok": None, "detail": f"the profiler recorded {len(kernels)} kernels "
                "(no CUPTI activity?)"}
    first = kernels[0]
    r_stream = first.get("args", {}).get("stream")
    last = [e for e in kernels if e.get("args", {}).get("stream") == r_stream][-1]
    hook_k = [e for e in kernels if e is not first and e is not last]
    off_r = [e for e in hook_k if e.get("args", {}).get("stream") != r_stream]
    codec = [e for e in hook_k if CODEC_KERNEL.search(e.get("name", ""))]
    end_first = first["ts"] + first.get("dur", 0)
    after_first = all(e["ts"] >= end_first for e in hook_k)
    before_last = all(e["ts"] + e.get("dur", 0) <= last["ts"] for e in hook_k)
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    corr = {e.get("args", {}).get("correlation"): e for e in api}
    launch = corr.get(first.get("args", {}).get("correlation"), {})
    lo, tid = launch.get("ts"), launch.get("tid")
    hi = corr.get(last.get("args", {}).get("correlation"), {}).get("ts")
    # this thread's calls between the two markers' launches (NCCL's watchdog has its own)
    calls = [e["name"] for e in api if lo is not None and hi is not None
             and lo < e["ts"] < hi and e.get("tid") == tid]
    syncs = sorted({c for c in calls if SYNC_CALL.search(c)})
    waits = sum(1 for c in calls if "StreamWaitEvent" in c)
    placed = bool(hook_k) and (len(off_r) == len(hook_k) or not side)
    ok = bool(placed and after_first and before_last and codec and not syncs)
    streams = sorted({str(e.get("args", {}).get("stream")) for e in hook_k})
    return {"ok": ok, "kernels": len(hook_k), "codec_kernels": len(codec),
            "streams": streams, "caller_stream": r_stream, "stream_waits": waits,
            "sync_calls": syncs, "runtime_calls": len(calls),
            "detail": (f"{len(hook_k)} kernels ({len(codec)} of the codec) on stream(s) "
                       f"{', '.join(streams) or 'none'} (caller's: {r_stream}); "
                       f"{'all after' if after_first else 'NOT all after'} the caller's earlier "
                       f"kernel and {'before' if before_last else 'NOT before'} its later one; "
                       f"{waits} stream waits; synchronizing calls: "
                       f"{', '.join(syncs) or 'none'} (of {len(calls)} CUDA API calls seen on "
                       "this thread)" + ("" if placed else "; some ran on the caller's stream"))}


def stream_checks(h: Harness, checks: Checks, preset: str) -> None:
    """The stream and event order of one loopback reduce-scatter, one all-gather (tagc-full)
    and one HSDP hook call, read from a CUDA profiler trace."""
    if not h.cuda:
        checks.add(preset, "stream order", "skipped", "no GPU (dry run): the profiler's "
                   "CUDA trace needs one")
        return
    marker = torch.zeros(1 << 16, device=h.device)
    tries: List[Tuple[str, Callable[[], None], bool]] = []
    pairs = getattr(h, "loopback_pairs", None)
    if pairs:
        dev_r = pairs[0][0]
        g = torch.randn(dev_r.flat_numel, device=h.device)
        o = torch.empty(dev_r.flat_numel // 2, device=h.device)

        def rs() -> None:
            with loopback():
                dev_r.reduce(g, o)
        tries.append(("loopback reduce-scatter", rs, True))
    state = getattr(h, "hsdp_state", None)
    if state is not None:
        r = state.units[0]
        t = torch.randn(r.shard_numel, device=h.device)
        tries.append(("HSDP all-reduce hook", lambda: type(r).hook(r, t), True))
    for what, call, side in tries:
        with checks.run(preset, f"stream order: {what}") as out:
            out.update(stream_order(call, marker, side))
            if out["ok"] is None:
                out["skip"] = out["detail"]


# ----------------------------------------------------------------------------- main
def init_group(device: torch.device, tmp: str) -> None:
    """A one-rank default process group: NCCL on CUDA, gloo on the CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'store')}",
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))


def run(device: torch.device, presets: Tuple[str, ...] = PRESETS) -> Dict[str, Any]:
    """Every check of every preset (see the module's docstring).

    Returns:
        ``{"device", "torch", "rows": [...]}``.
    """
    checks = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        init_group(device, tmp)
        try:
            for preset in presets:
                cfg = TAGCConfig.preset(preset)
                h = Harness(device)
                for part in (reduce_scatter_checks, hsdp_checks):
                    try:
                        part(h, checks, preset, cfg)
                    except Exception as exc:  # noqa: BLE001 - setup failed: the next part runs
                        checks.add(preset, part.__name__.replace("_", " "), "failed",
                                   f"{type(exc).__name__}: {exc}"[:500],
                                   traceback=traceback.format_exc()[-2000:])
                stream_checks(h, checks, preset)
                # one no-host-sync summary per preset
                bad = [(w, e) for w, s, e in h.sync_checks if s != "ok"]
                if h.cuda:
                    checks.add(preset, "no host sync", "failed" if bad or not h.sync_checks
                               else "ok", f"{len(h.sync_checks)} hook calls under "
                               f"set_sync_debug_mode('error'), {len(bad)} synchronized"
                               + (f": {bad[:2]}" if bad else ""))
                else:
                    checks.add(preset, "no host sync", "skipped",
                               "no GPU (dry run): torch.cuda.set_sync_debug_mode needs CUDA")
        finally:
            dist.destroy_process_group()
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "rows": checks.rows}


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: 0 when nothing failed, 1 otherwise, 2 when the device is missing."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    require_device("cuda_hook", args.device)
    device = torch.device(args.device)
    res = run(device, tuple(args.presets.split(",")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 1 if any(r["status"] == "failed" for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
