"""What one unit's reduction asks of the host on CUDA, counted on a CPU (issue 57 item 1).

On a GPU the codec's cost in a host-bound step is host work per call (docs/gpu: about
133 us a unit: flattening, encode, zero and decode, allocations and memsets, stream
waits), not kernel time.  GPU time is rare, so this proxy counts that work without one:
the reducer runs its CUDA branch (``Exec.cuda``: device flags instead of host reads,
poisoning instead of a plain fallback) on CPU tensors, the ``_tagc`` calls go to the
kernels' own code under the emulation (:class:`tagc_bench.cuda_emu.EmuOps`), and the
second rank is the loopback stand-in of ``tagc_bench.cuda_hook``.  Per call it counts:

* ``ext_calls``: calls into ``_tagc``; ``kernels`` / ``ext_memsets``: the launches and
  ``cudaMemsetAsync`` calls the launchers made (the emulation's counters);
  ``workspaces``: launcher workspaces, each a ``cudaMallocAsync`` and a
  ``cudaFreeAsync`` in the module;
* ``torch_kernels``: the aten ops the hook ran outside ``_tagc`` that launch a kernel
  on a GPU (views and factories excluded); ``allocs``: the caching-allocator
  allocations among them (factories, out-of-place results); ``memsets``: fills
  (``zero_``, ``fill_``, zero/full factories);
* ``syncs``: host reads of a device value (``.item()``, ``bool(t)``): must be 0;
* ``collectives``: calls to the process group (the loopback's copies stand in for them).

It cannot see the stream waits and switches around a call (``CodecStreams.around``, the
same on every path), NCCL or DLPack exports: only a GPU measures those microseconds.
``--time`` adds what the CPU can time: the hook's own host time per call (Python, the
torch ops on CPU tensors, the loopback's copies) with every CUDA op of ``_tagc`` a no-op
(:class:`NoOps`), a floor under what a GPU's host pays.  Usage::

    python3 scripts/bench/tagc_bench/host_counts.py          # the table, both paths, two presets
    python3 scripts/bench/tagc_bench/host_counts.py --time   # and the host us per call
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes as C
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tagc.reducer
from tagc.codec import _tagc
from tagc.config import TAGCConfig
from tagc_bench import cuda_emu
from tagc_bench.cuda_hook import LoopbackComm, loopback, unit_reducers

COUNTS = ("ext_calls", "kernels", "ext_memsets", "workspaces", "torch_kernels", "allocs",
          "memsets", "syncs", "collectives")
_FACTORIES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_FILLED = {"zeros", "zeros_like", "new_zeros", "full", "full_like", "new_full", "ones",
           "ones_like", "new_ones", "scalar_tensor"}
_FILLS = {"zero_", "fill_"}


class Counter(TorchDispatchMode):
    """Counts the aten ops run inside it (outside ``_tagc`` calls and the loopback's
    stand-ins for collectives) and, through :class:`CountingOps` and
    :class:`CountingComm`, the extension's calls and the collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Dict[str, int] = dict.fromkeys(COUNTS, 0)
        self.paused = 0

    @contextlib.contextmanager
    def outside(self, name: str) -> Iterator[None]:
        """Count one ``name`` and none of the aten ops inside."""
        self.counts[name] += 1
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        if self.paused or func.is_view:
            return out
        name = func._schema.name.split("::")[-1]
        c = self.counts
        if name == "_local_scalar_dense":
            c["syncs"] += 1
        elif name in _FACTORIES:
            c["allocs"] += 1
        elif name in _FILLED:
            c["allocs"] += 1
            c["memsets"] += 1
        elif name in _FILLS:
            c["memsets"] += 1
        else:
            c["torch_kernels"] += 1
            if not func._schema.is_mutable:
                outs = out if isinstance(out, (tuple, list)) else (out,)
                c["allocs"] += sum(isinstance(t, torch.Tensor) for t in outs)
        return out


class CountingOps:
    """:class:`cuda_emu.EmuOps` whose calls add to the active :class:`Counter`."""

    def __init__(self, ops: cuda_emu.EmuOps) -> None:
        self._ops = ops
        self.counter: Optional[Counter] = None

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._ops, name)
        if not callable(fn) or name.endswith("_bytes") or self.counter is None:
            return fn
        counter, lib = self.counter, self._ops.lib

        def call(*args: Any, **kw: Any) -> Any:
            before, after = (C.c_longlong * 2)(), (C.c_longlong * 2)()
            lib.tagc_emu_counters(before)
            try:
                with counter.outside("ext_calls"):
                    return fn(*args, **kw)
            finally:
                lib.tagc_emu_counters(after)
                counter.counts["kernels"] += after[0] - before[0]
                counter.counts["ext_memsets"] += after[1] - before[1]
        return call


class CountingComm(LoopbackComm):
    """The loopback stand-in for the other ranks, its copies counted as collectives (on
    a GPU they are NCCL calls, not the hook's kernels)."""

    counter: Optional[Counter] = None

    def _counted(self, method: Any, *args: Any, **kw: Any) -> Any:
        if self.counter is None:
            return method(*args, **kw)
        with self.counter.outside("collectives"):
            return method(*args, **kw)

    def all_reduce(self, *args: Any, **kw: Any) -> Any:
        return self._counted(super().all_reduce, *args, **kw)

    def all_gather(self, *args: Any, **kw: Any) -> Any:
        return self._counted(super().all_gather, *args, **kw)

    def reduce_scatter(self, *args: Any, **kw: Any) -> Any:
        return self._counted(super().reduce_scatter, *args, **kw)

    def post_send(self, *args: Any, **kw: Any) -> Any:
        return self._counted(super().post_send, *args, **kw)


@contextlib.contextmanager
def counted(ops: CountingOps) -> Iterator[None]:
    """Reducers called inside take their CUDA branch with the emulated kernels
    (:func:`cuda_emu.emulated_cuda`) and the loopback comm; the workspaces the launchers
    get are counted."""
    saved = (tagc.reducer.Comm, cuda_emu.ws)

    def counted_ws(nbytes: int) -> torch.Tensor:
        if nbytes > 0 and ops.counter is not None:
            ops.counter.counts["workspaces"] += 1
        return saved[1](nbytes)

    tagc.reducer.Comm = CountingComm  # type: ignore[misc]
    cuda_emu.ws = counted_ws
    try:
        with cuda_emu.emulated_cuda(ops):
            yield
    finally:
        tagc.reducer.Comm, cuda_emu.ws = saved


def count_calls(lib: Any, preset: str, unit_path: bool, steps: int = 3,
                shard: int = 64 * 40, world: int = 2) -> List[Dict[str, int]]:
    """The counts of each of ``steps`` calls of one unit (rank 0 of ``world``).

    Args:
        lib: the emulated library (:func:`cuda_emu.build`) or its path.
        preset: a shipped preset.
        unit_path: ``UnitReducer.UNIT_PATH`` for this reducer.
        steps: calls; the first also creates the feedback state.
        shard: values per shard.
        world: ranks.
    Returns:
        one dict of :data:`COUNTS` per call.
    """
    ops = CountingOps(cuda_emu.EmuOps(lib))
    cfg = TAGCConfig.preset(preset)
    n = world * shard
    (u,) = unit_reducers(cfg, [n], torch.device("cpu"), world, unit_path=unit_path)
    g = torch.Generator().manual_seed(0)
    out: List[Dict[str, int]] = []
    with counted(ops):
        for _ in range(steps):
            x = torch.randn(n, generator=g)
            y = torch.empty(shard)
            with Counter() as counter:
                ops.counter = CountingComm.counter = counter
                u.reduce(x, y)
            ops.counter = CountingComm.counter = None
            out.append(counter.counts)
    return out


class NoOps:
    """``_tagc`` whose CUDA ops (the methods of :class:`cuda_emu.EmuOps`) do nothing;
    the size helpers, seeds and errors are the C module's."""

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_") and callable(getattr(cuda_emu.EmuOps, name, None)):
            return lambda *args, **kw: None
        return getattr(_tagc, name)


def host_us(preset: str, unit_path: bool, calls: int = 500, repeats: int = 5,
            shard: int = 64 * 4, world: int = 2) -> float:
    """The hook's host time of one unit call on its CUDA branch with no-op kernels.

    Args:
        preset: a shipped preset.
        unit_path: ``UnitReducer.UNIT_PATH`` for this reducer.
        calls: calls per timed repeat (after as many untimed ones).
        repeats: timed repeats; the fastest counts (the least disturbed by the load).
        shard: values per shard (small: the loopback's copies stay negligible).
        world: ranks.
    Returns:
        microseconds per call.
    """
    cfg = TAGCConfig.preset(preset)
    n = world * shard
    (u,) = unit_reducers(cfg, [n], torch.device("cpu"), world, unit_path=unit_path)
    x, y = torch.randn(n, generator=torch.Generator().manual_seed(0)), torch.empty(shard)
    with loopback(), cuda_emu.emulated_cuda(NoOps()), _one_thread():
        for _ in range(calls):
            u.reduce(x, y)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                u.reduce(x, y)
            best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="an emulated library already built (default: build one)")
    ap.add_argument("--presets", nargs="+", default=["balanced", "full"])
    ap.add_argument("--time", action="store_true",
                    help="add the host us per call with no-op kernels (one thread)")
    args = ap.parse_args(argv)
    cols = list(COUNTS) + (["host us (no-op kernels)"] if args.time else [])
    with tempfile.TemporaryDirectory() as tmp:
        lib = args.lib or cuda_emu.build(tmp)
        print("| preset | path | " + " | ".join(cols) + " |")
        print("|---|---|" + "---|" * len(cols))
        for preset in args.presets:
            for unit_path in (False, True):
                c = count_calls(lib, preset, unit_path)[-1]
                row = [str(c[k]) for k in COUNTS]
                if args.time:
                    row.append(f"{host_us(preset, unit_path):.1f}")
                print(f"| {preset} | {'unit' if unit_path else 'general'} | "
                      + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
