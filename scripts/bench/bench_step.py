#!/usr/bin/env python3
"""Step-time benchmark of TAGC against plain FSDP on an emulated slow network.

Driver (default, needs root): brings up ``tagc/train/netem.sh`` hosts (one network namespace
per rank, veth links shaped by ``tc``), measures the link, then launches one ``torchrun``
node per namespace (``--nnodes N --node-rank i``, gloo bound to the veth) running this
file with ``--worker``. The worker runs every (sharding strategy, configuration) pair
round-robin, ``--repeats`` times, so drift hits all alike; each trial builds a fresh
GPT-2, wraps it in FSDP, optionally registers TAGC, runs warm-up steps and then timed
steps, reading the veth's own byte counters (``/sys/class/net/<if>/statistics``, the
numbers ``ip -s link`` prints) and ``state.stats()`` around the timed steps. A second,
shorter launch repeats everything with the link unshaped, which gives the share of
plain FSDP's step spent waiting on the link (``1 - t_unshaped / t_shaped``) and, per
configuration, where the time goes. Results, a markdown report (with the codec speed
table from ``bench_codec.py``) and a PNG chart go to ``--out``, by default a new
``docs/runs/step-<UTC date-time>/`` of this checkout: commit it with the figures a
document quotes from it (``scripts/bench/tagc_bench/outputs.py``).

With ``--hsdp`` the topology has two levels: ``--nodes`` hosts with ``--per-node`` ranks
each (``torchrun --nproc-per-node``), the ranks of a host on that namespace's unshaped
loopback route (the fast links inside a node), hosts on the shaped link. Two layouts
are compared round-robin: ``FULL_SHARD`` (FSDP2 over every rank, the slow link inside
every reduce-scatter and all-gather) and ``HSDP`` (sharded inside a host, replicated
across hosts: plain ``fsdp`` is native HSDP, a TAGC configuration is TAGC's custom HSDP,
which compresses only the all-reduce between hosts).

Usage:
    sudo python3 scripts/bench/bench_step.py --quick      # < 5 min
    sudo python3 scripts/bench/bench_step.py              # full run
    sudo python3 scripts/bench/bench_step.py --hsdp       # 2 hosts x 2 ranks, HSDP
    sudo python3 scripts/bench/bench_step.py --hsdp --nodes 4 --per-node 1 --strategies HSDP
                                                          # 4 hosts x 1 rank (R = 4)
    sudo python3 scripts/bench/bench_step.py --model gpt2-124m --fsdp 2 --strategies FULL_SHARD \
        --rate 200mbit 1gbit --no-codec       # issue 42: GPT-2 124M, 8 rows, 3 link rates

Besides the step times every trial records the bytes of every collective by the ideal
count at the ``torch.distributed`` call (:func:`call_bytes`: what NCCL would send, FSDP's
and TAGC's collectives alike), each rank's peak RSS over the trial and, with the
unshaped pass, each configuration's exposed communication (shaped step - unshaped
step, in the report).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from tagc import presets, teardown
from tagc.cost.rows import ROWS, Row
from tagc.cost.shapes import BENCH_MODELS, ModelShape
from tagc.train.runs import NETEM, free_port, netem, shown
from tagc_bench.outputs import run_dir

logger = logging.getLogger(__name__)

# the checkout this script sits in (scripts/bench/): where --out's default folder goes
ROOT = Path(__file__).resolve().parents[2]

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")
HSDP_CONFIGS = ["fsdp", "dense", "exact", "sparse", "balanced", "lean"]


# --------------------------------------------------------------------------- worker


def _read_counters(ifname: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of ``ifname`` in this process's network namespace."""
    base = Path("/sys/class/net") / ifname / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def _numeric_delta(after: dict, before: dict) -> dict:
    """Per-key difference of the numeric entries of two (possibly nested) stats dicts."""
    out: dict = {}
    for k, v in after.items():
        b = before.get(k) if isinstance(before, dict) else None
        if isinstance(v, dict):
            out[k] = _numeric_delta(v, b if isinstance(b, dict) else {})
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v - (b if isinstance(b, (int, float)) and not isinstance(b, bool) else 0)
    return out


def _scale(d: dict, f: float) -> dict:
    """Multiply every number of a nested dict by ``f``."""
    return {k: _scale(v, f) if isinstance(v, dict) else v * f for k, v in d.items()}


def _on_main_thread() -> bool:
    """Whether the caller is the thread running the model (not TAGC's worker, which
    runs exchanges beside the compute: ``fsdp_overlap``, ``hsdp_overlap``)."""
    import threading

    return threading.current_thread() is threading.main_thread()


class _CodecTimer:
    """Wraps the ``_tagc`` module's functions to add up the wall time spent in them.

    The module's attributes are looked up at call time, so every codec call is timed:
    :attr:`seconds` those on the thread running the model (the codec's share of its
    step), :attr:`worker_seconds` those on TAGC's worker thread (beside the compute).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.worker_seconds = 0.0
        self.calls = 0
        self.installed = False

    def install(self) -> None:
        """Replace every public callable of ``_tagc`` with a timing wrapper (once)."""
        if self.installed:
            return
        try:
            import _tagc  # noqa: PLC0415 - only present once the codec is built
        except ImportError:
            logger.warning("_tagc not importable: codec time not measured")
            return
        for name in dir(_tagc):
            fn = getattr(_tagc, name)
            if name.startswith("_") or not callable(fn) or isinstance(fn, type):
                continue
            setattr(_tagc, name, self._wrap(fn))
        self.installed = True

    def _wrap(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if _on_main_thread():
                    self.seconds += time.perf_counter() - t0
                else:
                    self.worker_seconds += time.perf_counter() - t0
                self.calls += 1

        timed.__name__ = getattr(fn, "__name__", "timed")
        timed.__doc__ = fn.__doc__
        return timed


class _WorkTimer:
    """Proxy for an async ``Work``: adds the time spent in ``wait()`` to a timer."""

    def __init__(self, work: Any, timer: "_CommTimer") -> None:
        self._work, self._timer = work, timer

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._timer.timed("wait", self._work.wait, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _CommTimer:
    """Wall time this rank spends inside torch.distributed collectives (FSDP's and TAGC's).

    Synchronous calls are timed whole; for ``async_op=True`` the issue and the later
    ``wait()`` are timed. This includes waiting for the slower peer, as any
    in-collective measurement does; :attr:`events` (each call and wait: name, entry,
    exit, on the host's monotonic clock, which every rank of this machine shares) let
    :func:`peer_wait` split that part off.  :attr:`seconds` and the events are the
    thread running the model's: its collectives and its waits for TAGC's worker
    (``fsdp_overlap`` / ``hsdp_overlap``), whose own collectives run beside the
    compute and go to :attr:`worker_seconds`.
    """

    # the package-level names FSDP1/FSDP2 and TAGC call; nested calls inside
    # distributed_c10d go through that module's globals, so nothing is counted twice
    NAMES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
             "reduce_scatter_single", "all_reduce", "all_to_all_single", "reduce", "all_gather",
             "broadcast", "all_to_all", "reduce_scatter", "isend", "irecv")

    # the parameter all-gathers (FSDP's own or TAGC's quantized ones): counted apart;
    # pair_all_gather is TAGC's two-rank gloo all-gather (tagc/comm.py)
    GATHERS = ("all_gather_into_tensor", "all_gather_single", "pair_all_gather")

    def __init__(self) -> None:
        import threading

        self.seconds = 0.0
        self.worker_seconds = 0.0
        # bytes this rank sent by the ideal count (call_bytes), every collective and the
        # parameter all-gathers of them
        self.call_bytes = 0.0
        self.gather_bytes = 0.0
        self.events: list[tuple[str, float, float]] = []
        # a wrapped call made inside another (pair_all_gather's isend/irecv) is part
        # of the outer one's time: counted once
        self._inside = threading.local()

    def record(self, name: str, t0: float, t1: float) -> None:
        """One timed call or wait."""
        if not _on_main_thread():
            self.worker_seconds += t1 - t0
            return
        self.seconds += t1 - t0
        self.events.append((name, t0, t1))

    def install(self) -> None:
        """Wrap the collectives in ``torch.distributed`` (FSDP and TAGC call them by attribute)."""
        import torch.distributed as dist

        import tagc.comm

        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(fn))
        # TAGC calls it through its module (tagc/comm.py, tagc/gather.py)
        tagc.comm.pair_all_gather = self._wrap(tagc.comm.pair_all_gather)
        # the model's thread waiting for TAGC's worker: a gather's work (FSDP waits on
        # it), the backward's final wait for the deferred reductions
        import tagc.overlap

        for cls in (tagc.overlap.JobWork, tagc.overlap.Overlap):
            cls.wait = lambda *a, fn=cls.wait, **k: self.timed("wait", fn, *a, **k)

    def timed(self, name: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, recorded as one ``name`` call or wait."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.record(name, t0, time.perf_counter())

    def _wrap(self, fn: Callable) -> Callable:
        import inspect

        gather = fn.__name__ in self.GATHERS
        sig = inspect.signature(fn)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "depth", 0):
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            sent = call_bytes(fn.__name__, bound.arguments)
            self.call_bytes += sent
            if gather:
                self.gather_bytes += sent
            self._inside.depth = 1
            t0 = time.perf_counter()
            try:
                work = fn(*args, **kwargs)
            finally:
                self.record(fn.__name__, t0, time.perf_counter())
                self._inside.depth = 0
            return _WorkTimer(work, self) if work is not None and hasattr(work, "wait") else work

        timed.__name__ = getattr(fn, "__name__", "timed")
        timed.__doc__ = fn.__doc__
        return timed



def _nbytes(t: Any) -> int:
    """Bytes of a tensor."""
    return t.numel() * t.element_size()


def _own_split(a: dict, rank: int, w: int) -> float:
    """Bytes of an all_to_all_single's input that stay on this rank (its own split)."""
    inp, splits = a["input"], a["input_split_sizes"]
    if not splits:
        return _nbytes(inp) / w
    return splits[rank] * _nbytes(inp) / max(inp.shape[0], 1)


def _group_rank(a: dict, key: str, group: Any) -> int:
    """The group rank of a reduce's destination or a broadcast's source."""
    import torch.distributed as dist

    given = a.get(f"group_{key}")
    return given if given is not None else dist.get_group_rank(group or dist.group.WORLD, a[key])


# name -> bytes this rank sends in one call, from (arguments by name, group size, rank in
# the group), as NCCL's ring would send them (nccl-tests' bus bytes per rank): the
# all-gathers (w-1)/w of the gathered buffer, reduce-scatters (w-1)/w of the input,
# all-reduce 2(w-1)/w, an all-to-all what leaves the rank, a reduce or broadcast the
# buffer from every rank but one (a reduce: all but the destination, as TAGC's stats
# count it; a broadcast: (w-1)/w on each), a send its buffer, a receive nothing
_CALL_BYTES: dict[str, Callable[[dict, int, int], float]] = {
    "all_gather_into_tensor": lambda a, w, r: (w - 1) * _nbytes(a["input_tensor"]),
    "all_gather_single": lambda a, w, r: (w - 1) * _nbytes(a["input_tensor"]),
    "all_gather": lambda a, w, r: (w - 1) * _nbytes(a["tensor"]),
    "pair_all_gather": lambda a, w, r: (w - 1) * _nbytes(a["inp"]),
    "reduce_scatter_tensor": lambda a, w, r: (w - 1) / w * _nbytes(a["input"]),
    "reduce_scatter_single": lambda a, w, r: (w - 1) / w * _nbytes(a["input"]),
    "reduce_scatter": lambda a, w, r: (w - 1) / w * sum(_nbytes(t) for t in a["input_list"]),
    "all_reduce": lambda a, w, r: 2 * (w - 1) / w * _nbytes(a["tensor"]),
    "all_to_all_single": lambda a, w, r: _nbytes(a["input"]) - _own_split(a, r, w),
    "all_to_all": lambda a, w, r: sum(_nbytes(t) for i, t in enumerate(a["input_tensor_list"])
                                      if i != r),
    "reduce": lambda a, w, r: 0 if r == _group_rank(a, "dst", a["group"]) else _nbytes(a["tensor"]),
    "broadcast": lambda a, w, r: (w - 1) / w * _nbytes(a["tensor"]),
    "isend": lambda a, w, r: _nbytes(a["tensor"]),
    "irecv": lambda a, w, r: 0,
}


def call_bytes(name: str, a: dict) -> float:
    """Bytes one call sends from this rank by the ideal count, counted at the
    ``torch.distributed`` call: what NCCL would put on the link, not what gloo does
    (its reduce-scatter is an all-reduce underneath; the veth counters show that).

    Args:
        name: the function (a name of :attr:`_CommTimer.NAMES` or ``pair_all_gather``).
        a: its arguments by name, defaults applied (``inspect.BoundArguments``).
    Returns:
        the bytes.
    """
    import torch.distributed as dist

    group = a.get("group")
    # pair_all_gather(out, inp, rank, group): two ranks by definition
    w = 2 if name == "pair_all_gather" else dist.get_world_size(group)
    return _CALL_BYTES[name](a, w, dist.get_rank(group))


def peer_wait(events: list[list[tuple[str, float, float]]]) -> list[float] | None:
    """Per rank, the seconds of its timed collectives spent before the last rank arrived.

    The ranks issue the same collectives in the same order (one program, symmetric
    layouts), so call k of every rank is one collective; a rank that enters it before
    the last one waits for that one (at most the call's own duration), and the rest of
    its time in the call is the transfer.  On this machine the ranks of the emulated
    hosts share the cores, so that wait is mostly the skew of time-sliced ranks.

    Args:
        events: per rank, its (name, entry, exit) in call order, on one shared clock.
    Returns:
        the seconds per rank, or None when the ranks' sequences differ (names or
        lengths: then calls cannot be matched by position).
    """
    if not events or any(len(e) != len(events[0]) for e in events):
        return None
    waits = [0.0] * len(events)
    for calls in zip(*events):
        if any(c[0] != calls[0][0] for c in calls):
            return None
        last = max(c[1] for c in calls)
        for r, (_, t0, t1) in enumerate(calls):
            waits[r] += min(max(last - t0, 0.0), t1 - t0)
    return waits


def _hsdp(model: Any, cfg: Any, preset: str | None, per_node: int) -> Any:
    """Shard inside a host, replicate across hosts: native HSDP for plain FSDP, TAGC's
    custom HSDP otherwise (the same units either way); returns the mesh."""
    import torch.distributed as dist
    import tagc_hook as tagc
    from tagc.selection import modules_to_wrap
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # torchrun numbers the ranks host by host, so a row of this mesh is one host
    mesh = init_device_mesh("cpu", (dist.get_world_size() // per_node, per_node),
                            mesh_dim_names=("replicate", "shard"))
    if preset is not None:
        tagc.shard_model(model, cfg, mesh=mesh)
        return mesh
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    for mod in sorted(modules_to_wrap(model, cfg), key=lambda m: -order[id(m)]):
        fully_shard(mod, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def _build(shape: ModelShape, strategy: str, row: Row, fsdp: int, config_dir: Path,
           per_node: int = 1, override: dict | None = None):
    """Fresh GPT-2 wrapped in FSDP (same units for every configuration), TAGC optional.

    Args:
        shape: model and batch shape.
        strategy: "FULL_SHARD", "SHARD_GRAD_OP" or (FSDP2) "HSDP".
        row: the configuration (preset, precision, resharding, its own overrides).
        fsdp: 1 (FullyShardedDataParallel) or 2 (fully_shard).
        config_dir: directory holding the presets.
        per_node: ranks per host (the shard dimension of HSDP).
        override: TAGC config fields replacing the preset's in every configuration
            (plain FSDP's units too); the row's own overrides apply on top.

    Returns:
        (model, optimizer, tagc state or None).
    """
    import torch
    import tagc_hook as tagc
    from tagc.train.model import GPT

    torch.manual_seed(0)
    model = GPT(shape.gpt_config())
    mesh = None  # the HSDP mesh, which register needs too
    preset, bf16 = row.preset, row.bf16
    override = {**(override or {}), **row.fields}
    # the wrapping depends on the layer policy only, so plain FSDP gets the same units
    # as TAGC (compressed and uncompressed parameters in different units)
    path = config_dir / f"{preset or ROWS['exact'].preset}.yaml"
    cfg = tagc.TAGCConfig.from_yaml(str(path), override) if preset or path.exists() \
        else tagc.TAGCConfig.from_dict(override)
    if fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        from torch.distributed.fsdp import ShardingStrategy

        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
            if bf16 else None
        model = FSDP(model, sharding_strategy=getattr(ShardingStrategy, strategy),
                     auto_wrap_policy=tagc.fsdp1_auto_wrap_policy(model, cfg),
                     device_id=torch.device("cpu"), mixed_precision=mp)
    elif strategy == "HSDP":
        mesh = _hsdp(model, cfg, preset, per_node)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.bfloat16)} if bf16 else {}
        # FSDP2 has no strategy enum: SHARD_GRAD_OP = keep parameters gathered after
        # forward, as a gather-once row does under FULL_SHARD
        tagc.shard_model(model, cfg, reshard_after_forward=strategy == "FULL_SHARD" and row.reshard,
                         **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if cfg.outer_every and mesh is None:  # the mesh exists on the HSDP route only
        raise SystemExit(f"bench_step: {preset} takes local steps, TAGC's HSDP route: "
                         "run it with --hsdp")
    # local steps end a round from the optimizer's step hook
    state = tagc.register(model, cfg, mesh=mesh,
                          optimizer=opt if cfg.outer_every else None) \
        if preset is not None else None
    return model, opt, state


def _profile_step(step: Callable[[], None], rank: int, top: int = 12) -> str | None:
    """One extra (untimed) step under torch.profiler; rank 0's top ops by self CPU time.

    Args:
        step: the training step.
        rank: this rank (only rank 0 keeps its table).
        top: rows kept.

    Returns:
        The profiler's table on rank 0, None elsewhere.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    if rank != 0:
        return None
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48)


def _trial(args: argparse.Namespace, shape: ModelShape, rep: int, strategy: str, name: str,
           gen: Any, timer: "_CodecTimer", comm: "_CommTimer", ifname: str | None,
           hosts: int) -> dict:
    """One (strategy, configuration) trial: build, warm up, time ``args.steps`` steps.

    Args:
        args: the worker's arguments.
        shape: model and batch shape.
        rep: round-robin pass.
        strategy: layout (FULL_SHARD, SHARD_GRAD_OP, HSDP).
        name: configuration (a key of ``tagc.cost.rows.ROWS``).
        gen: this rank's batch generator.
        timer: codec time.
        comm: time in collectives.
        ifname: the veth whose counters this rank reads, or None.
        hosts: emulated hosts (the counters are summed over them).

    Returns:
        The trial's record (per-step times, bytes, time split, stats deltas).
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    # this trial's peak RSS, not the process's: the previous trial's model collected
    # first, then the high-water mark reset
    gc.collect()
    rss_reset = _reset_peak_rss()
    model, opt, state = _build(shape, strategy, ROWS[name], args.fsdp, Path(args.config_dir),
                               args.per_node, _overrides(args.override))
    x = torch.randint(0, shape.vocab_size, (shape.batch, shape.block_size), generator=gen)
    y = torch.randint(0, shape.vocab_size, (shape.batch, shape.block_size), generator=gen)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(x, y)
        loss = out[1] if isinstance(out, tuple) else out
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    s0 = state.stats() if state is not None else {}
    c0 = _read_counters(ifname) if ifname else (0, 0)
    k0, m0, g0, b0 = timer.seconds, comm.seconds, comm.gather_bytes, comm.call_bytes
    kw0, mw0 = timer.worker_seconds, comm.worker_seconds
    comm.events.clear()
    busy0, cpu0 = _host_busy(), time.process_time()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    cpu1, busy1 = time.process_time(), _host_busy()
    c1 = _read_counters(ifname) if ifname else (0, 0)
    k1, m1, g1, b1 = timer.seconds, comm.seconds, comm.gather_bytes, comm.call_bytes
    kw1, mw1 = timer.worker_seconds, comm.worker_seconds
    # kB on Linux (getrusage(2))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    every: list[Any] = [None] * world
    # not a wrapped name: neither timed nor counted
    dist.all_gather_object(every, (list(comm.events), peak_rss))
    waits = peer_wait([e for e, _ in every])
    s1 = state.stats() if state is not None else {}
    # max over ranks per step: a step ends when its slowest rank ends
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    # TAGC's own all-gathers (HSDP's to-everyone phase, over the replicas: one per
    # host) are gradient bytes, already in the stats column: not parameter gathers
    g_tagc = (hosts - 1) * (_tagc_gathered(s1) - _tagc_gathered(s0))
    # veth counters: sum over hosts; codec and comm time: over ranks
    v = torch.tensor([c1[0] - c0[0], c1[1] - c0[1], k1 - k0, m1 - m0, g1 - g0 - g_tagc,
                      cpu1 - cpu0, b1 - b0, kw1 - kw0, mw1 - mw0], dtype=torch.float64)
    dist.all_reduce(v, op=dist.ReduceOp.SUM)
    trial = {
        "rep": rep, "strategy": strategy, "config": name,
        "step_s": t.tolist(),
        "veth_tx_per_step_per_host": v[0].item() / args.steps / hosts,
        "veth_rx_per_step_per_host": v[1].item() / args.steps / hosts,
        "codec_s_per_step_per_rank": v[2].item() / args.steps / world,
        "comm_s_per_step_per_rank": v[3].item() / args.steps / world,
        # TAGC's worker thread (fsdp_overlap, hsdp_overlap): its codec calls and its
        # collectives, beside the compute
        "worker_codec_s_per_step_per_rank": v[7].item() / args.steps / world,
        "worker_comm_s_per_step_per_rank": v[8].item() / args.steps / world,
        # of it, waiting for the last rank to enter each collective (None: unmatched)
        "peer_wait_s_per_step_per_rank": None if waits is None else
        sum(waits) / args.steps / world,
        # ideal ring bytes of the parameter all-gathers, per host as the veth counters
        "gather_tx_per_step_per_host": v[4].item() / args.steps / hosts,
        # every collective's bytes by the ideal count at the call (call_bytes), FSDP's
        # and TAGC's: what NCCL would send
        "call_tx_per_step_per_rank": v[6].item() / args.steps / world,
        # each rank's peak resident memory over this trial (build, warm-up, timed
        # steps); a lifetime peak where it could not be reset (peak_rss_reset false)
        "peak_rss_per_rank": [r for _, r in every],
        "peak_rss_reset": rss_reset,
        # CPU time of the rank's process (every thread, user + system) while timed
        "cpu_s_per_step_per_rank": v[5].item() / args.steps / world,
        # the whole machine's busy CPU-seconds over the timed steps (every rank, the
        # kernel's network work included; None without /proc/stat): with ranks
        # time-sliced on fewer cores, a step near cores x step is bound by the CPUs
        "host_busy_cpu_s_per_step": None if busy0 is None or busy1 is None else
        (busy1 - busy0) / args.steps,
        "stats_delta_per_step": _scale(_numeric_delta(s1, s0), 1.0 / args.steps),
        "stats_total_after": s1.get("total") if rank == 0 else None,
    }
    if name in args.profile and rep == args.repeats - 1:
        trial["profile"] = _profile_step(step, rank)
    if rank == 0:
        logger.info("rep %d %-13s %-9s median %.3fs  veth tx %.2f MB/step/host", rep,
                    strategy, name, statistics.median(trial["step_s"]),
                    trial["veth_tx_per_step_per_host"] / 1e6)
    return trial


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS, which ``getrusage`` reports (Linux: writing 5 to
    ``/proc/self/clear_refs``, proc(5)), so the next reading is one trial's peak.

    Returns:
        whether it was reset (False: the reading is the process's peak so far).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _host_busy() -> float | None:
    """Busy CPU-seconds of the whole machine since boot (``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    # guest time is already counted in user (proc(5)): the first 8 fields only
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _tagc_gathered(stats: dict) -> int:
    """Bytes this rank handed to TAGC's all-gathers so far (``state.stats()``)."""
    coll = (stats.get("total") or {}).get("collectives", {})
    return sum(coll.get(op, {}).get("bytes", 0) for op in _CommTimer.GATHERS)


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per emulated host
    dist.init_process_group("gloo")
    teardown.install()  # the plain trials register no hook (tagc/teardown.py)
    rank, world = dist.get_rank(), dist.get_world_size()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    # a host's ranks share its veth: its first rank alone reads the counters
    have_if = bool(ifname) and (Path("/sys/class/net") / ifname).exists()
    reads_if = have_if and int(os.environ.get("LOCAL_RANK", "0")) == 0
    hosts = world // args.per_node
    shape = ModelShape(**json.loads(args.shape))
    timer = _CodecTimer()
    timer.install()
    comm = _CommTimer()
    comm.install()
    trials = []
    t_start = time.perf_counter()
    gen = torch.Generator().manual_seed(1234 + rank)
    for rep in range(args.repeats):
        for strategy in args.strategies:
            for name in args.configs:
                trials.append(_trial(args, shape, rep, strategy, name, gen, timer, comm,
                                     ifname if reads_if else None, hosts))
    if rank == 0:
        out = {"world": world, "per_node": args.per_node, "fsdp": args.fsdp,
               "shape": asdict(shape), "ifname": ifname, "have_counters": have_if, "codec_timed": timer.installed,
               "wall_s": time.perf_counter() - t_start, "trials": trials,
               "torch": torch.__version__}
        Path(args.result).write_text(json.dumps(out, indent=1, default=str))
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- driver


def _launch(net: list[str], args: argparse.Namespace, configs: list[str], repeats: int,
            steps: int, result: Path, timeout: float, profile: list[str] | None = None) -> dict:
    """Run the worker on every emulated host; return rank 0's result dict."""
    if result.exists():
        result.unlink()
    cmd = ["bash", str(NETEM), *net, "torchrun", "--port", str(free_port()), "--timeout",
           str(int(timeout)), "--nproc-per-node", str(args.per_node), "--",
           str(Path(__file__).resolve()), "--worker", "--per-node", str(args.per_node),
           *(["--hsdp"] if args.hsdp else []), "--override", *args.override,
           "--result", str(result), "--fsdp", str(args.fsdp), "--shape", json.dumps(asdict(args.shape_obj)),
           "--config-dir", str(Path(args.config_dir).resolve()),
           "--repeats", str(repeats), "--steps", str(steps), "--warmup", str(args.warmup),
           "--configs", *configs, "--strategies", *args.strategies, "--profile", *(profile or [])]
    logger.info("launch: %s", " ".join(cmd))
    env = dict(os.environ, OMP_NUM_THREADS="1", TAGC_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, timeout=timeout + 60, env=env)
    if r.returncode != 0 or not result.exists():
        raise RuntimeError(f"benchmark workers failed (exit {r.returncode}); see the log above")
    return json.loads(result.read_text())


def _codec_table(timeout: float, quick: bool) -> str:
    """Markdown output of bench_codec.py (``--quick`` in quick mode), with its command."""
    script = Path(__file__).resolve().with_name("bench_codec.py")
    if not script.exists():
        return "(scripts/bench/bench_codec.py not present: codec speed not measured)\n"
    cmd = [sys.executable, str(script)] + (["--quick"] if quick else [])
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        return (f"(scripts/bench/bench_codec.py failed with exit {r.returncode}:\n"
                f"{r.stderr[-2000:]})\n")
    head = (f"`python3 scripts/bench/bench_codec.py{' --quick' if quick else ''}` "
            f"({time.perf_counter() - t0:.0f} s, run after the network was torn down)\n\n")
    return head + r.stdout


def _rate_dirs(out: Path, rates: list[str]) -> dict[str, Path]:
    """Where each shaped rate's report goes: ``out`` itself for one rate, a folder per
    rate inside it (``out/200mbit``) for several, each a complete report.

    Args:
        out: the run's folder.
        rates: the shaped rates, as ``--rate`` gives them.
    Returns:
        {rate: folder}.
    """
    return {r: out if len(rates) == 1 else out / r for r in rates}


def _driver(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        sys.exit("bench_step.py: needs root to build the emulated network (tagc/train/netem.sh); "
                 "run with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            sys.exit(f"bench_step.py: '{tool}' not found (iproute2: apt-get install -y iproute2)")
    out = Path(args.out)
    dirs = _rate_dirs(out, args.rate)
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    if args.predictions:
        from tagc.cost.bench import estimate_text  # noqa: PLC0415 - only with the option

        logger.info("%s", estimate_text(json.loads(Path(args.predictions).read_text()),
                                        _plan(args)))
    prefix = f"tagcb{os.getpid() % 1000}"

    def net(rate: str) -> list[str]:
        """netem.sh's options for the emulated hosts at ``rate``."""
        return ["--prefix", prefix, "-n", str(args.nodes), "--rate", rate, "--delay", args.delay]

    t_wall = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    common: dict = {"args": {k: shown(v) if k in ("out", "config_dir", "predictions") and v else v
                             for k, v in vars(args).items() if k != "shape_obj"},
                    "shape": asdict(args.shape_obj),
                    "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    common["args"]["rates"] = common["args"].pop("rate")
    common["loadavg_start"], common["cpus"] = os.getloadavg(), os.cpu_count()
    reports = {r: {"args": {**common["args"], "rate": r}} for r in args.rate}
    try:
        netem(net(args.rate[0]), "up")
        for rate in args.rate:
            netem(net(rate), "rate", rate)
            rep = reports[rate]
            rep["link_shaped"] = netem(net(rate), "measure", str(args.measure_mb),
                                       timeout=600).strip()
            logger.info("%s", rep["link_shaped"])
            rep["shaped"] = _launch(net(rate), args, args.configs, args.repeats, args.steps,
                                    dirs[rate] / "raw_shaped.json", args.timeout, args.profile)
        if not args.no_unshaped:
            netem(net("none"), "rate", "none")
            link = netem(net("none"), "measure", str(args.measure_mb), timeout=600).strip()
            # one unshaped pass serves every shaped rate (its exposed communication)
            unshaped = _launch(net("none"), args, _unshaped_configs(args), args.unshaped_repeats,
                               args.steps, out / "raw_unshaped.json", args.timeout)
            for rep in reports.values():
                rep["link_unshaped"], rep["unshaped"] = link, unshaped
    finally:
        netem(net(args.rate[0]), "down", check=False)
    codec = _codec_table(args.timeout, args.quick) if not args.no_codec else "(skipped)\n"
    ended = {"codec_table": codec, "wall_s": time.perf_counter() - t_wall,
             "loadavg_end": os.getloadavg(),
             "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    for rate, rep in reports.items():
        rep.update({**common, **ended, "args": rep["args"]})
        (dirs[rate] / "results.json").write_text(json.dumps(rep, indent=1, default=str))
        # report.md and the chart, printed: bench_report.py beside this file (which
        # re-renders them later)
        subprocess.run([sys.executable, str(Path(__file__).resolve().with_name("bench_report.py")),
                        str(dirs[rate] / "results.json")], check=True)
    print(f"\nwall time {ended['wall_s']:.0f} s; reports: "
          + ", ".join(f"{d}/report.md" for d in dirs.values()))
    return 0


def _plan(args: argparse.Namespace) -> dict:
    """The run's plan as the cost model's run-time estimate takes it."""
    return {"rates": args.rate, "configs": args.configs, "warmup": args.warmup,
            "steps": args.steps, "repeats": args.repeats,
            "unshaped_repeats": 0 if args.no_unshaped else args.unshaped_repeats,
            "unshaped_configs": _unshaped_configs(args)}


def _unshaped_configs(args: argparse.Namespace) -> list[str]:
    """The configurations of the unshaped pass: with --quick only plain FSDP (its
    communication share), else every configuration (each one's exposed communication)."""
    return ([c for c in args.configs if c == "fsdp"] if args.quick else []) or args.configs


def _overrides(items: list[str]) -> dict:
    """``KEY=VALUE`` strings as a dict (values parsed as YAML), checked against TAGCConfig."""
    import yaml

    out = {}
    for it in items:
        key, eq, val = it.partition("=")
        if not eq or not key:
            raise ValueError(f"--override: expected KEY=VALUE, got {it!r}")
        out[key] = yaml.safe_load(val)
    if out:
        import tagc_hook as tagc

        tagc.TAGCConfig.from_dict({**tagc.TAGCConfig().to_dict(), **out})  # unknown keys raise
    return out


def _config_name(name: str) -> str:
    """A configuration as --configs takes it: a preset's name without ``tagc-``."""
    return name[len("tagc-"):] if name.startswith("tagc-") else name


def _layout_defaults(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the layout options left out and refuse the combinations that cannot run."""
    if args.hsdp:
        if args.fsdp == 1:
            p.error("--hsdp needs FSDP2 (FSDP1 refuses comm hooks on HYBRID_SHARD)")
        args.fsdp, args.per_node = 2, args.per_node or 2
        args.strategies = args.strategies or ["FULL_SHARD", "HSDP"]
        args.configs = args.configs or list(HSDP_CONFIGS)
        if args.per_node < 1:
            p.error("--hsdp needs --per-node >= 1")
    args.fsdp, args.per_node = args.fsdp or 1, args.per_node or 1
    args.strategies = args.strategies or list(STRATEGIES)
    args.configs = args.configs or list(BENCH_MODELS[args.model].configs)
    if "HSDP" in args.strategies and not args.hsdp:
        p.error("strategy HSDP needs --hsdp")
    once = [c for c in args.configs if not ROWS[c].reshard]
    if once and (args.fsdp == 1 or args.hsdp):
        p.error(f"{', '.join(once)}: gathering once is FSDP2's reshard_after_forward=False under "
                "FULL_SHARD (FSDP1: --strategies SHARD_GRAD_OP)")
    if "none" in args.rate and not args.no_unshaped:
        p.error("--rate none is the unshaped pass: add --no-unshaped to run it as the only one")
    if args.hsdp and "SHARD_GRAD_OP" in args.strategies:
        p.error("--hsdp compares FULL_SHARD and HSDP")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the driver or, with --worker, one rank.

    Args:
        argv: command line (default sys.argv[1:]).

    Returns:
        Process exit code.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run, under 5 minutes")
    p.add_argument("--out", default=None,
                   help="report folder (default: a new docs/runs/step-<UTC date-time>/ of this "
                        "checkout, to commit with the figures quoted from it)")
    p.add_argument("--nodes", type=int, default=2, help="emulated hosts (default 2)")
    p.add_argument("--hsdp", action="store_true",
                   help="two-level topology (--per-node ranks per host, FSDP2): FULL_SHARD "
                        "over every rank against HSDP (native and TAGC's)")
    p.add_argument("--per-node", type=int, default=None,
                   help="ranks per emulated host (default 1; 2 with --hsdp)")
    p.add_argument("--rate", nargs="+", default=["200mbit"],
                   help="tc rate per link (default 200mbit); several: a shaped pass at each, "
                        "in order, one report folder per rate inside --out, the unshaped pass "
                        "once for all ('none' alone with --no-unshaped: an unshaped run)")
    p.add_argument("--model", choices=sorted(BENCH_MODELS), default="bench",
                   help="the model (default bench: tagc.cost.shapes.ModelShape's defaults; "
                        "gpt2-124m: GPT-2 small, vocab 50257, context 256); it sets the "
                        "defaults of --configs, --warmup, --steps, --repeats and "
                        "--unshaped-repeats, and the --n-layer ... options change its shape")
    p.add_argument("--predictions", default=None,
                   help="the cost model's predictions of this run (cost_model.py "
                        "--predict-rows): the run's estimated wall time is printed first")
    p.add_argument("--delay", default="0.1ms")
    p.add_argument("--fsdp", type=int, choices=(1, 2), default=None, help="default 1 (2 with --hsdp)")
    p.add_argument("--configs", nargs="+", default=None, choices=list(ROWS), type=_config_name,
                   help="configurations: fsdp (plain) or a preset's name, with or without "
                        "tagc- (balanced = tagc-balanced)")
    p.add_argument("--strategies", nargs="+", default=None, choices=[*STRATEGIES, "HSDP"],
                   help="default FULL_SHARD SHARD_GRAD_OP (FULL_SHARD HSDP with --hsdp)")
    p.add_argument("--repeats", type=int, default=None, help="round-robin passes (shaped link)")
    p.add_argument("--unshaped-repeats", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per trial")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--profile", nargs="*", default=[], choices=list(ROWS), type=_config_name,
                   help="configurations to profile (one extra untimed step under torch.profiler "
                        "in the last shaped repeat; table in the report)")
    p.add_argument("--config-dir", default=None,
                   help="folder of the TAGC YAML presets (default: the shipped ones, "
                        "tagc.presets.config_dir())")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="TAGC config fields set in every configuration, YAML values "
                        "(e.g. layers=all); the units of plain FSDP follow")
    p.add_argument("--no-unshaped", action="store_true", help="skip the unshaped-link pass")
    p.add_argument("--no-codec", action="store_true", help="skip bench_codec.py")
    p.add_argument("--measure-mb", type=int, default=10)
    p.add_argument("--timeout", type=float, default=3000, help="seconds per launch")
    for f in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "batch"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=None)
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for k in ("repeats", "steps", "warmup", "unshaped_repeats", "nodes", "measure_mb", "per_node"):
        v = getattr(args, k)
        if v is not None and v < (0 if k == "warmup" else 1):
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    _layout_defaults(p, args)
    args.config_dir = args.config_dir or str(presets.config_dir())
    try:
        _overrides(args.override)
    except ValueError as e:
        p.error(str(e))
    if args.worker:
        return _worker(args)
    plan = BENCH_MODELS[args.model]
    args.warmup = plan.warmup if args.warmup is None else args.warmup
    args.repeats = args.repeats or (1 if args.quick else plan.repeats)
    args.steps = args.steps or (2 if args.quick else plan.steps)
    args.unshaped_repeats = args.unshaped_repeats or (1 if args.quick else plan.unshaped_repeats)
    shape = {f: getattr(args, f) for f in asdict(plan.shape) if getattr(args, f) is not None}
    args.shape_obj = ModelShape(**{**asdict(plan.shape), **shape})
    args.out = args.out or str(run_dir(ROOT, "step"))
    return _driver(args)


if __name__ == "__main__":
    sys.exit(main())
