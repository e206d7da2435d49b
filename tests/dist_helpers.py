"""Multi-process gloo harness for the hook tests (CPU, 127.0.0.1, strict timeouts).

``run_dist(fn, world_size, *args)`` spawns ``world_size`` processes that join one
gloo process group (FileStore rendezvous, no port to race for), run
``fn(rank, world_size, *args)`` and send back its (picklable, small) return
value.  A worker exception is re-raised in the parent with the worker's
traceback; a hang is killed after ``timeout`` seconds and fails the test.
Several cases share one spawn by looping inside ``fn``: spawning costs seconds
(each child imports torch), collectives cost milliseconds.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store_path: str,
            args: tuple, out: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)  # 2 shared cores: N processes x 1 thread
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=60))
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
        fn: a module-level function (spawned children import it by name).
        world_size: number of processes.
        *args: extra picklable arguments.
        timeout: seconds before every worker is killed and the call fails.
    Returns:
        the return values, indexed by rank.
    Raises:
        AssertionError: a worker raised (its traceback is in the message),
            or the run timed out.
    """
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="tagc-dist-")
    store = os.path.join(tmp, "store")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store, args, out),
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


# --------------------------------------------------------------------------- named cases

def run_cases(rank: int, world_size: int, cases: List[Tuple[str, Callable[..., Any]]],
              *args: Any) -> Dict[str, Tuple[str, Any]]:
    """Run named cases in one spawn, each isolated: ``{name: ("ok", result)}`` or
    ``{name: ("fail", traceback)}``.  Cases run in the same order on every rank; a case
    that fails on one rank only can leave the others waiting in a collective until the
    group's timeout, after which they fail too, so the first failure names the culprit."""
    out: Dict[str, Tuple[str, Any]] = {}
    for name, fn in cases:
        try:
            out[name] = ("ok", fn(rank, world_size, *args))
        except Exception:  # reported per case; the spawn goes on with the next one
            out[name] = ("fail", traceback.format_exc())
    return out


def case_result(results: List[Dict[str, Tuple[str, Any]]], name: str) -> List[Any]:
    """Every rank's result of one case from :func:`run_cases`; fails naming the case
    (with each failing rank's traceback) if it failed anywhere."""
    bad = [f"--- rank {r} ---\n{res[name][1]}" for r, res in enumerate(results)
           if res[name][0] != "ok"]
    if bad:
        raise AssertionError(f"case {name} failed:\n" + "\n".join(bad))
    return [res[name][1] for res in results]


class SharedSpawn:
    """The results of one spawn of a suite function per world size, shared by the
    parametrized tests that each check one of its cases (spawning dominates the cost).

    Args:
        suite: a module-level ``fn(rank, world_size) -> run_cases(...)``.
        timeout: seconds for a spawn (see :func:`run_dist`).
    """

    def __init__(self, suite: Callable[[int, int], Dict[str, Tuple[str, Any]]],
                 timeout: float) -> None:
        self._suite, self._timeout = suite, timeout
        self._runs: Dict[int, List[Dict[str, Tuple[str, Any]]]] = {}

    def case(self, world_size: int, name: str) -> List[Any]:
        """Every rank's result of case ``name`` at ``world_size`` (spawns on first use;
        a failed spawn is retried by the next call); fails as :func:`case_result`."""
        if world_size not in self._runs:
            self._runs[world_size] = run_dist(self._suite, world_size, timeout=self._timeout)
        return case_result(self._runs[world_size], name)


# --------------------------------------------------------------------------- toy model

class _Attn(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn = torch.nn.Linear(d, 3 * d)   # QKV: never compressed by default
        self.c_proj = torch.nn.Linear(d, d)       # output projection: compressed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.c_proj(w @ v)


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(d)
        self.attn = _Attn(d)
        self.ln_2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ToyGPT(torch.nn.Module):
    """A tiny GPT-shaped model; odd sizes so FSDP pads every unit for N = 3, 4."""

    def __init__(self, vocab: int = 37, d: int = 10, layers: int = 2) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.h = torch.nn.ModuleList(_Block(d) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


def toy_batch(rank: int, step: int, vocab: int = 37, batch: int = 2, seq: int = 7) -> torch.Tensor:
    """Different data per rank and step, identical across runs."""
    g = torch.Generator().manual_seed(1000 * step + rank + 1)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def build_fsdp(kind: str, cfg: Any = None, seed: int = 0, reduce_dtype: Any = None,
               **model_kw: Any) -> torch.nn.Module:
    """A ToyGPT wrapped by FSDP1 (`kind="fsdp1"`) or FSDP2 (`"fsdp2"`) with TAGC's helpers.

    With ``cfg=None`` the same unit layout is built with the default config's
    policy so a plain-FSDP reference has identical units.
    """
    import tagc_hook as tagc

    torch.manual_seed(seed)
    model = ToyGPT(**model_kw)
    pcfg = cfg if cfg is not None else tagc.TAGCConfig(mode="dense", min_numel=64)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        mp_ = MixedPrecision(reduce_dtype=reduce_dtype) if reduce_dtype is not None else None
        return FSDP(model, auto_wrap_policy=tagc.fsdp1_auto_wrap_policy(model, pcfg),
                    mixed_precision=mp_, device_id=torch.device("cpu"))
    from torch.distributed.fsdp import MixedPrecisionPolicy
    kw = {}
    if reduce_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    return tagc.shard_model(model, pcfg, **kw)


def local_grads(model: torch.nn.Module) -> List[torch.Tensor]:
    """This rank's sharded gradients, in parameter order (FSDP1 flat or FSDP2 DTensor)."""
    out = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            out.append(torch.zeros(0))
            continue
        if hasattr(g, "to_local"):
            g = g.to_local()
        out.append(g.detach().reshape(-1).float().clone())
    return out
