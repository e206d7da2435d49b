"""N gloo ranks on this machine, in new processes (CPU, 127.0.0.1, strict timeouts).

``run_dist(fn, world_size, *args)`` starts ``world_size`` processes that join one
gloo process group (FileStore rendezvous, no port to race for), run
``fn(rank, world_size, *args)`` and send back its (picklable, small) return
value.  A worker exception is re-raised in the parent with the worker's
traceback; a hang is killed after ``timeout`` seconds.
The processes are forked from multiprocessing's fork server, which imports torch,
FSDP and TAGC once (a fresh interpreter per rank would import them again: about 2 s
of CPU each); they run with the caller's environment of the call.  Several cases
still share one start by looping inside ``fn``: a start costs a fraction of a second,
collectives cost milliseconds.  Used by the tests
(tests/dist_helpers.py) and scripts/bench/measure_bytes.py.
"""
from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tagc import teardown


# What every rank imports, loaded once into multiprocessing's fork server: each rank is
# forked from it instead of starting a fresh interpreter that imports torch and FSDP again
# (about 2 s of CPU per rank, most of a short run's cost).  The server itself only
# imports: it holds no process group, no OpenMP pool and no tensor for a child to inherit.
_PRELOAD = ["torch", "torch.distributed.fsdp", "tagc_hook"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts
    return ctx


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store_path: str,
            args: tuple, out: Any, environ: dict) -> None:
    # a forked rank inherits the fork server's environment, not the caller's of now
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)  # 2 shared cores: N processes x 1 thread
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=60))
        teardown.install()  # gloo's workers may touch Python at exit (tagc/teardown.py)
        res = fn(rank, world_size, *args)
        out.put((rank, "ok", res))
    except BaseException:  # report everything, including assertion failures
        out.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_dist(fn: Callable[..., Any], world_size: int, *args: Any,
             timeout: float = 150.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: a module-level function (the children import it by name).
        world_size: number of processes.
        *args: extra picklable arguments.
        timeout: seconds before every worker is killed and the call fails.
    Returns:
        the return values, indexed by rank.
    Raises:
        AssertionError: a worker raised (its traceback is in the message),
            or the run timed out.
    """
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="tagc-dist-")
    store = os.path.join(tmp, "store")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store, args, out,
                                                   dict(os.environ)),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world_size
    errors = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    got = 0
    try:
        while got < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise AssertionError(f"run_dist({fn.__name__}, N={world_size}) timed out "
                                     f"after {timeout}s; errors so far: {errors}")
            try:
                rank, status, val = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                if errors and all(not p.is_alive() for p in procs):
                    break
                if any(p.exitcode not in (None, 0) for p in procs):
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if all(results[r] is None for r in dead) and not errors:
                        raise AssertionError(f"worker(s) {dead} died without a report")
                continue
            got += 1
            if status == "ok":
                results[rank] = val
            else:
                errors.append(f"--- rank {rank} ---\n{val}")
                # the others may be stuck in a collective with the failed rank
                deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=20))
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(errors))
    return results
