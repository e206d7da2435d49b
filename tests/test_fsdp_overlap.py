"""``fsdp_overlap``: FSDP2's reduce-scatters and all-gathers on TAGC's worker thread.

Against the same model with ``fsdp_overlap=False`` (the comms block on the calling
thread), bit for bit: every step's gradients as ``backward()`` returns them, the
parameters after AdamW and the feedback state, with and without quantized gathers,
with FSDP's ``reshard_after_forward`` on and off.  Also: the exchanges really ran on
the worker (counted) and none is in flight when ``backward()`` returns; the forward
prefetch TAGC sets follows the first forward's order and leaves a user's own alone;
gradient accumulation and a bf16 reduce dtype (FSDP reads the output at once) wait
for their exchange and still equal the blocking comms; ``exact_gathers()`` validation
between steps; a failing gather or reduce-scatter fails that forward or backward with
a clear error on every rank, and the next step is whole again.  The worker itself
(order, errors, waiting) is tests/test_overlap.py.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch

import tagc_hook as tagc
from dist_helpers import SharedSpawn, ToyGPT, local_grads, run_cases, toy_batch

pytestmark = [pytest.mark.codec, pytest.mark.dist]


def _cfg(**kw: Any) -> tagc.TAGCConfig:
    base = dict(mode="quant", quant_format="int4", layers="all", min_numel=0,
                gather="int8", gather_block=16, error_feedback=True, ef21=False)
    base.update(kw)
    return tagc.TAGCConfig(**base)


def _pair(cfg: tagc.TAGCConfig, **shard_kw: Any) -> Tuple[Any, Any, Any, Any]:
    """The same model twice: overlapped (``cfg``) and blocking."""
    out = []
    for c in (cfg, dataclasses.replace(cfg, fsdp_overlap=False)):
        torch.manual_seed(0)
        model = tagc.shard_model(ToyGPT(d=24, layers=3), c, **shard_kw)
        out += [model, tagc.register(model, c)]
    assert out[1]._overlap is not None and out[3]._overlap is None
    return tuple(out)  # type: ignore[return-value]


def _units(model: torch.nn.Module) -> List[Any]:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _equal(a: List[torch.Tensor], b: List[torch.Tensor], what: Any) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), (what, i, float((x - y).abs().max()))


def _params(model: torch.nn.Module) -> List[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _equals_blocking(rank: int, n: int, cfg: tagc.TAGCConfig,
                     **shard_kw: Any) -> Dict[str, Any]:
    ov, ov_state, blk, blk_state = _pair(cfg, **shard_kw)
    worker = ov_state._overlap
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ov, blk)]
    units = len(ov_state.units)
    for step in range(3):
        for m in (ov, blk):
            m(toy_batch(rank, step)).sum().backward()
            assert worker.pending == 0  # backward() returns with every exchange done
        _equal(local_grads(ov), local_grads(blk), ("grads", step))
        for o in opts:
            o.step()
            o.zero_grad()
        if step == 0:
            # the forward prefetch follows the first forward's gathers: each unit
            # prefetches the next one it gathered
            fo = next(g._all_gather_comm.order for u in _units(ov)
                      for g in u._get_fsdp_state()._fsdp_param_groups)
            order = [fo.mods[i] for i in fo.order]
            assert len(order) == units, (len(order), units)
            for a, b in zip(order, order[1:]):
                assert a._get_fsdp_state()._states_to_forward_prefetch == \
                    [b._get_fsdp_state()]
    assert worker.deferred == 3 * units, (worker.deferred, units)
    handed = worker.handed
    assert handed >= 3 * units  # every gather ran on the worker
    _equal(_params(ov), _params(blk), "params")
    for ua, ub in zip(ov_state.units, blk_state.units):
        for name, _, _ in ua.feedback_buffers():
            x, y = getattr(ua, name), getattr(ub, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    # validation between steps, then accumulation: the second backward finds every
    # .grad set, so each unit waits for its exchange (nothing more deferred)
    with ov_state.exact_gathers(), blk_state.exact_gathers(), torch.no_grad():
        _equal([ov(toy_batch(rank, 9))], [blk(toy_batch(rank, 9))], "exact validation")
    for step in (3, 4):
        for m in (ov, blk):
            m(toy_batch(rank, step)).sum().backward()
    assert worker.deferred == 4 * units, worker.deferred
    _equal(local_grads(ov), local_grads(blk), "accumulated")
    a, b = ov_state.stats()["total"], blk_state.stats()["total"]
    for key in ("calls", "wire_bytes", "gather_calls", "gather_wire_bytes"):
        assert a[key] == b[key], (key, a[key], b[key])
    return {"deferred": worker.deferred, "handed": worker.handed, "units": units}


def _bf16(rank: int, n: int) -> int:
    """A bf16 reduce dtype: FSDP casts the output right after the comm, so no unit
    is deferred; every exchange still runs on the worker and equals the blocking."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    ov, ov_state, blk, _ = _pair(_cfg(), mp_policy=mp)
    for m in (ov, blk):
        m(toy_batch(rank, 0)).float().sum().backward()
    _equal(local_grads(ov), local_grads(blk), "bf16")
    assert ov_state._overlap.deferred == 0 and ov_state._overlap.handed > 0
    return ov_state._overlap.handed


def _user_prefetch(rank: int, n: int) -> None:
    """A model that sets its own forward prefetch keeps it."""
    cfg = _cfg(gather="none")
    torch.manual_seed(0)
    model = tagc.shard_model(ToyGPT(d=24, layers=3), cfg)
    units = _units(model)
    blocks = [u for u in units if u is not model]
    blocks[0].set_modules_to_forward_prefetch([blocks[2]])
    state = tagc.register(model, cfg)
    model(toy_batch(rank, 0)).sum().backward()
    assert state._overlap.deferred == len(state.units)
    got = {id(u): u._get_fsdp_state()._states_to_forward_prefetch for u in units}
    assert got[id(blocks[0])] == [blocks[2]._get_fsdp_state()]
    assert all(not v for k, v in got.items() if k != id(blocks[0])), got


def _errors(rank: int, n: int) -> List[str]:
    """A reduce-scatter failing on the worker fails the backward and stops the worker:
    the exchanges queued behind it never ran and the next forward fails at once with
    the first error; a gather failing there fails the forward.  Both say so, on every
    rank alike, instead of hanging."""
    cfg = _cfg()
    seen = []
    for what in ("reduce-scatter", "gather"):
        torch.manual_seed(0)
        model = tagc.shard_model(ToyGPT(d=24, layers=3), cfg)
        state = tagc.register(model, cfg)

        def broken(*a: Any, what: str = what) -> None:
            raise ValueError(f"injected {what}")

        if what == "gather":
            state.gathers[2]._quantized = broken
            try:
                model(toy_batch(rank, 3))
            except RuntimeError as e:
                assert "overlapped parameter all-gather failed" in str(e), str(e)
                assert isinstance(e.__cause__, ValueError)
                seen.append(what)
            assert state._overlap.pending == 0 and state._overlap.failed
            continue
        state.units[1].reduce = broken  # before its collectives, alike on every rank
        try:
            model(toy_batch(rank, 1)).sum().backward()
        except RuntimeError as e:
            assert "overlapped FSDP2 reduce-scatter failed" in str(e), str(e)
            assert isinstance(e.__cause__, ValueError)
            seen.append(what)
        assert state._overlap.pending == 0 and state._overlap.failed
        calls = [u.stats_dict()["calls"] for u in state.units]
        # the root unit reduces last, behind the failed one: never run
        assert calls[1] == 0 and calls[0] == 0 and sum(calls) == len(calls) - 2, calls
        try:
            model(toy_batch(rank, 2))
        except RuntimeError as e:
            assert "reduce-scatter failed: injected reduce-scatter" in str(e), str(e)
            seen.append("next forward")
    assert seen == ["reduce-scatter", "next forward", "gather"], seen
    return seen


def _suite(rank: int, n: int) -> Dict[str, Any]:
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    return run_cases(rank, n, [
        ("int8_gathers", lambda r, w: _equals_blocking(r, w, _cfg())),
        ("exact_gathers", lambda r, w: _equals_blocking(r, w, _cfg(gather="none"))),
        ("no_reshard", lambda r, w: _equals_blocking(r, w, _cfg(),
                                                     reshard_after_forward=False)),
        ("ef21", lambda r, w: _equals_blocking(r, w, _cfg(quant_format="ternary",
                                                          ef21=True, gather="int4"))),
        ("bf16", _bf16),
        ("user_prefetch", _user_prefetch),
        ("errors", _errors),
    ])


SPAWN = SharedSpawn(_suite, timeout=300)
CASES = ["int8_gathers", "exact_gathers", "no_reshard", "ef21", "bf16", "user_prefetch",
         "errors"]


@pytest.mark.parametrize("case", CASES)
def test_fsdp_overlap_n2(case: str) -> None:
    SPAWN.case(2, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fsdp_overlap_n3(case: str) -> None:
    SPAWN.case(3, case)
