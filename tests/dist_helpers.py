"""Multi-process gloo harness for the hook tests (CPU, 127.0.0.1, strict timeouts).

``run_dist(fn, world_size, *args)`` (tagc.train.launch) starts ``world_size``
processes that join one gloo process group, run ``fn(rank, world_size, *args)`` and
send back its return value; a worker exception fails the test with the worker's
traceback, a hang is killed after ``timeout`` seconds.  Several cases share one
spawn by looping inside ``fn`` (:func:`run_cases`, :class:`SharedSpawn`): a start
costs a fraction of a second (each child is forked with torch imported), collectives
cost milliseconds.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch

from tagc.train.launch import run_dist  # also the tests' entry point to it

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
