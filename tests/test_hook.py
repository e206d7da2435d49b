"""Multi-rank tests of tagc_hook on gloo: FSDP1 and FSDP2, N = 1..4.

One spawn per world size runs every case (spawning dominates the cost); each
case asserts inside the workers and the first failure is re-raised here with
the worker's traceback.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dist_helpers import build_fsdp, local_grads, run_dist, toy_batch  # noqa: E402

import tagc_hook as tagc  # noqa: E402

HAVE_CODEC = tagc._tagc is not None
KINDS = ("fsdp1", "fsdp2")
MIN_NUMEL = 64


def _cfg(mode: str, **kw: Any) -> tagc.TAGCConfig:
    return tagc.TAGCConfig(mode=mode, min_numel=MIN_NUMEL, **kw)


def _backward(model: torch.nn.Module, rank: int, step: int, kind: str, accum: int = 1) -> None:
    """One optimizer step's worth of backward, ``accum`` micro-batches (sync on the last)."""
    for micro in range(accum):
        last = micro == accum - 1
        x = toy_batch(rank, 100 * step + micro)
        if kind == "fsdp1":
            if last:
                model(x).backward()
            else:
                with model.no_sync():
                    model(x).backward()
        else:
            model.set_requires_gradient_sync(last)
            model(x).backward()


def _tap(state: tagc.TAGCState) -> Dict[str, List[torch.Tensor]]:
    """Record, per unit, the sum over calls of raw inputs and of un-averaged outputs."""
    rec: Dict[str, List[torch.Tensor]] = {}
    orig = state._run

    def run(u: Any, inp: torch.Tensor, out: torch.Tensor) -> None:
        x = inp.detach().reshape(-1).double().clone()
        orig(u, inp, out)
        y = out.detach().double() * (u.pre * u.post)
        r = rec.setdefault(u.name, [torch.zeros_like(x), torch.zeros_like(y)])
        r[0] += x
        r[1] += y

    state._run = run  # type: ignore[method-assign]
    return rec


def _check_equal_default(rank: int, n: int, kind: str, cfg: tagc.TAGCConfig,
                         reduce_dtype: Any = None, tol: float = 1e-6, accum: int = 1) -> None:
    ref = build_fsdp(kind, None, reduce_dtype=reduce_dtype)
    mod = build_fsdp(kind, cfg, reduce_dtype=reduce_dtype)
    state = tagc.register(mod, cfg)
    for step in range(2):
        _backward(ref, rank, step, kind, accum)
        _backward(mod, rank, step, kind, accum)
        ga, gb = local_grads(mod), local_grads(ref)
        # relative to this rank's largest gradient entry: peeling subtracts
        # bucket-mates, so a tiny bias gradient carries its bucket's rounding
        scale = max(float(b.abs().max()) for b in gb if b.numel())
        for i, (a, b) in enumerate(zip(ga, gb)):
            err = float((a - b).abs().max()) / scale if b.numel() else 0.0
            assert err <= tol, (f"{kind} {cfg.mode} N={n} step {step} param {i}: "
                                f"rel err {err:.3g} > {tol}")
        ref.zero_grad()
        mod.zero_grad()
    st = state.stats()["total"]
    expect_calls = 2 * sum(1 for u in state.units)
    if kind == "fsdp2" and n == 1:
        expect_calls = 0  # FSDP2 does not call the comm with one rank
    assert st["calls"] == expect_calls, (st["calls"], expect_calls)
    if expect_calls:
        assert st["compressed_calls"] > 0 and st["plain_calls"] > 0


def _check_conservation(rank: int, n: int, kind: str, cfg: tagc.TAGCConfig, steps: int = 20,
                        accum: int = 1) -> Dict[str, Any]:
    mod = build_fsdp(kind, cfg)
    state = tagc.register(mod, cfg)
    rec = _tap(state)
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    for step in range(steps):
        _backward(mod, rank, step, kind, accum)
        opt.step()
        opt.zero_grad()
    for u in state.units:
        if not u.compressed or u.name not in rec:
            continue
        raw, out = rec[u.name]
        s = out.numel()
        full = torch.zeros(n * s, dtype=torch.float64)
        full[rank * s:(rank + 1) * s] = out
        res = u.residual.double().clone() if u.residual is not None else torch.zeros_like(raw)
        for t in (raw, full, res):
            dist.all_reduce(t)
        err = float((full + res - raw).abs().max())
        scale = float(raw.abs().max())
        assert err <= 1e-5 * max(scale, 1e-12) + 1e-6, (
            f"{kind} {cfg.mode} N={n} unit {u.name}: mass error {err:.3g} (scale {scale:.3g})")
        if n > 1 and cfg.theta > 0.5:
            assert float(res.abs().max()) > 0, "residual empty: nothing was dropped?"
    return state.stats()["total"]


_COUNTED = ("all_to_all_single", "all_reduce", "reduce", "reduce_scatter_single",
            "reduce_scatter_tensor")


def _check_bytes(rank: int, n: int, kind: str, cfg: tagc.TAGCConfig) -> Dict[str, Any]:
    """stats() byte counts == bytes of the tensors handed to torch.distributed."""
    mod = build_fsdp(kind, cfg)
    state = tagc.register(mod, cfg)
    seen: Dict[str, List[int]] = {}
    saved = {name: getattr(dist, name) for name in _COUNTED if hasattr(dist, name)}

    def wrap(name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if name == "all_to_all_single":
                t = kwargs.get("input", args[1] if len(args) > 1 else None)
            elif name.startswith("reduce_scatter"):
                t = kwargs.get("input", args[1] if len(args) > 1 else None)
            else:
                t = kwargs.get("tensor", args[0] if args else None)
            c = seen.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += t.numel() * t.element_size()
            return fn(*args, **kwargs)
        return counted

    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        for step in range(3):
            _backward(mod, rank, step, kind)
            mod.zero_grad()
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    coll = state.stats()["total"]["collectives"]
    assert {k: [v["calls"], v["bytes"]] for k, v in coll.items()} == seen, (coll, seen)
    return state.stats()["compressed_total"]


def _modes() -> List[str]:
    return ["dense"] + (["exact", "sparse"] if HAVE_CODEC else [])


def _suite(rank: int, n: int) -> Dict[str, Any]:
    warnings.filterwarnings("ignore")
    out: Dict[str, Any] = {}
    for kind in KINDS:
        for mode in _modes():
            cfg = _cfg(mode) if mode == "dense" else _cfg(mode, theta=0.0)
            _check_equal_default(rank, n, kind, cfg)
        # gradient accumulation and bf16 reduction (fp32 inside, one rounding)
        _check_equal_default(rank, n, kind, _cfg("dense"), accum=2)
        _check_equal_default(rank, n, kind, _cfg("dense"), reduce_dtype=torch.bfloat16,
                             tol=2e-2)
        if HAVE_CODEC:
            _check_equal_default(rank, n, kind, _cfg("exact", theta=0.0), accum=2)
            _check_equal_default(rank, n, kind, _cfg("sparse", theta=0.0),
                                 reduce_dtype=torch.bfloat16, tol=2e-2)
        for mode in _modes():
            out[f"bytes/{kind}/{mode}"] = _check_bytes(rank, n, kind, _cfg(mode))
        if HAVE_CODEC and not (kind == "fsdp2" and n == 1):
            for mode in ("exact", "sparse"):
                out[f"ef/{kind}/{mode}"] = _check_conservation(
                    rank, n, kind, _cfg(mode, theta=0.9875), steps=20)
            # accumulation + error feedback
            _check_conservation(rank, n, kind, _cfg("sparse", theta=0.9), steps=4, accum=2)
            # undersized sketch: peeling fails, the recovery exchange keeps mass
            st = _check_conservation(rank, n, kind, _cfg("exact", theta=0.5,
                                                         sketch_factor=0.5), steps=3)
            assert st["unpeeled"] > 0 and st["recovered"] == st["unpeeled"], st
            out[f"recovery/{kind}"] = st
            out[f"paper/{kind}"] = _paper_stats(rank, n, kind)
    return out


def _paper_stats(rank: int, n: int, kind: str) -> Dict[str, Any]:
    res = {}
    for bits in (1, 4):
        cfg = _cfg("paper", theta=0.8, ratio=2, index_bits=bits)
        mod = build_fsdp(kind, cfg)
        state = tagc.register(mod, cfg)
        for step in range(3):
            _backward(mod, rank, step, kind)
            mod.zero_grad()
        st = state.stats()["compressed_total"]
        if bits == 4 or n == 1:
            assert st["collision_dropped"] == 0, st   # no carry with <= 15 ranks
        res[bits] = {k: st[k] for k in ("collision_dropped", "collision_dropped_l1",
                                        "unpeeled", "density")}
    return res


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_hook_suite(n: int) -> None:
    out = run_dist(_suite, n, timeout=400)
    r0 = out[0]
    for key, st in r0.items():
        if key.startswith("paper/") and n >= 2:
            # with theta=0.8 the ranks' kept sets overlap; 1-bit SUM lanes carry
            # and the loss is reported, not hidden
            assert st[1]["collision_dropped"] > 0, (key, st)
