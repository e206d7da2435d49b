"""TAGC's custom HSDP on gloo: 4 processes as 2 replicas x 2 shards (FSDP2 shards inside
a "node", the hook compresses the all-reduce between the two), and 3 or 4 replicas of
one rank for the two-phase all-reduce.

Cases: dense equals native HSDP bit for bit; every mode without error feedback equals
the independent reference (:func:`reference_allreduce`: the test's own compress ->
sum -> compress in pure torch, per form); error feedback conserves gradient mass (with
two-phase, the owners' ``residual_out`` included); EF21's estimates agree; the
replicas end every step with the same sum, bit for bit, in every compressing mode with
feedback; the bypass works on both forms and loses nothing; the bytes per rank are
the forms' formulas; a non-finite gradient takes the plain path with the state
untouched (CPU); a wrong mesh gets a clear error; checkpoint resume in new processes
is bitwise (torch.save per rank and torch.distributed.checkpoint), for both forms.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from dist_helpers import SharedSpawn, ToyGPT, local_grads, run_cases, run_dist, toy_batch

import tagc_hook as tagc

pytestmark = [pytest.mark.codec, pytest.mark.dist]
R, S = 2, 2


def test_hsdp_allreduce_form() -> None:
    """HSDP's all-reduce form: two-phase where it sends fewer bytes (quant: counted on
    the shard's codes; the others from 3 replicas) and always for the union modes,
    all-gather at 2, for dense and for uncompressed units; a forced form wins;
    exact/paper have no all-gather form; unknown names raise."""
    from tagc import hsdp

    form = hsdp.allreduce_form
    s = 2 ** 16
    q = tagc.TAGCConfig(mode="quant")
    assert [form(q, r, True, s) for r in (1, 2, 3, 4, 64)] == \
        ["gather", "gather", "two_phase", "two_phase", "two_phase"]
    # ternary with its owners on int4: (R-1)/R (1.75 + 4.125) bits against 1.75
    t = tagc.TAGCConfig(mode="quant", quant_format="ternary")
    assert t.out_format() == "int4"
    assert [form(t, r, True, s) for r in (2, 3, 4, 64)] == \
        ["gather", "gather", "two_phase", "two_phase"]
    t1 = tagc.TAGCConfig(mode="quant", quant_format="ternary", hsdp_out_format="ternary")
    assert [form(t1, r, True, s) for r in (2, 3)] == ["gather", "two_phase"]
    assert form(tagc.TAGCConfig(mode="sparse", theta=0.9), 3, True, s) == "two_phase"
    assert form(q, 8, False, s) == "gather"
    assert form(tagc.TAGCConfig(mode="dense"), 8, True, s) == "gather"
    assert form(tagc.TAGCConfig(mode="exact"), 2, True, s) == "two_phase"
    assert form(tagc.TAGCConfig(mode="quant", hsdp_allreduce="two_phase"), 2, True, s) == \
        "two_phase"
    assert form(tagc.TAGCConfig(mode="quant", hsdp_allreduce="gather"), 8, True, s) == "gather"
    with pytest.raises(NotImplementedError, match="all-gather form"):
        form(tagc.TAGCConfig(mode="paper", ratio=4, hsdp_allreduce="gather"), 4, True, s)
    with pytest.raises(ValueError, match="hsdp_allreduce"):
        tagc.TAGCConfig(hsdp_allreduce="ring")
    assert tagc.TAGCConfig(mode="quant", quant_format="int8").out_format() == "int8"
    assert tagc.TAGCConfig(mode="quant", quant_format="sign").out_format() == "int4"
    assert tagc.TAGCConfig(mode="quant", hsdp_out_format="ternary").out_format() == "ternary"
    with pytest.raises(ValueError, match="hsdp_out_format"):
        tagc.TAGCConfig(hsdp_out_format="int2")


def _mesh(replicas: int = R, shards: int = S) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _cfg(mode: str, **kw: Any) -> tagc.TAGCConfig:
    kw.setdefault("min_numel", 64)
    # the knobs whose library defaults became tagc-balanced's (issue 38), pinned to the
    # values these tests were written for: the paper's selection, residual feedback
    kw.setdefault("layers", "non_attention")
    kw.setdefault("ef21", False)
    kw.setdefault("residual_code", "none")  # the fp32 residual (issue 42's default: int4 codes)
    return tagc.TAGCConfig(mode=mode, **kw)


def _tagc_model(cfg: tagc.TAGCConfig, mesh: Any) -> Tuple[Any, Any]:
    torch.manual_seed(0)
    model = tagc.shard_model(ToyGPT(), cfg, mesh=mesh)
    return model, tagc.register(model, cfg, mesh=mesh)


def _native(cfg: tagc.TAGCConfig, mesh: Any) -> Any:
    """Native HSDP (2-D mesh) with the same units and SUM reductions."""
    from torch.distributed.fsdp import fully_shard

    from tagc.selection import modules_to_wrap

    torch.manual_seed(0)
    model = ToyGPT()
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    for mod in sorted(modules_to_wrap(model, cfg), key=lambda m: -order[id(m)]):
        fully_shard(mod, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    return model


def _step(model: Any, rank: int, step: int) -> None:
    model(toy_batch(rank, step)).backward()


def _dense_equals_native(rank: int, n: int, shape: Tuple[int, int] = (R, S)) -> None:
    """Dense TAGC HSDP's gradients equal native HSDP's bit for bit (FSDP's averaging
    included: with one rank per node, shape (R, 1), FSDP2 skips the reduce-scatter)."""
    mesh = _mesh(*shape)
    ref = _native(_cfg("dense"), mesh)
    model, state = _tagc_model(_cfg("dense"), mesh)
    for step in range(2):
        for m in (ref, model):
            _step(m, rank, step)
        for i, (a, b) in enumerate(zip(local_grads(model), local_grads(ref))):
            assert torch.equal(a, b), (step, i, float((a - b).abs().max()))
        ref.zero_grad()
        model.zero_grad()
    st = state.stats()["total"]
    assert st["calls"] == 2 * len(state.units) and st["collectives"]["all_reduce"]["calls"] > 0


def _tap(state: Any) -> Dict[str, List[torch.Tensor]]:
    """Record each unit's all-reduce input and output (the sum over the replicas,
    before the divide the hook applies after it)."""
    seen: Dict[str, List[torch.Tensor]] = {}
    for u in state.units:
        orig = u._all_reduce

        def all_reduce(t: torch.Tensor, u: Any = u, orig: Any = orig) -> None:
            x = t.detach().reshape(-1).clone()
            orig(t)
            seen[u.name] = [x, t.detach().reshape(-1).clone()]

        u._all_reduce = all_reduce
    return seen


def _compress_ref(x: torch.Tensor, cfg: tagc.TAGCConfig, fmt: str = "") -> torch.Tensor:
    """What one rank contributes of x without error feedback: its block codes
    decoded (quant, on ``fmt``, default ``quant_format``) or its top k (the others)."""
    if cfg.mode == "quant":
        from test_quant import encode_ref

        return torch.from_numpy(encode_ref(x.numpy(), fmt or cfg.quant_format,
                                           cfg.quant_block)[1])
    k = min(max(math.ceil(round((1 - cfg.theta) * x.numel(), 9)), 1), x.numel())
    keep = torch.sort(torch.sort(x.abs(), descending=True, stable=True).indices[:k]).values
    out = torch.zeros_like(x)
    out[keep] = x[keep]
    return out


def reference_allreduce(every: List[torch.Tensor], cfg: tagc.TAGCConfig,
                        form: str) -> torch.Tensor:
    """The sum over the replicas the hook must produce without error feedback, from
    every replica's shard, in pure torch (test_quant's encoder for the codes).

    ``gather``: every replica's shard compressed whole, summed in replica order.
    ``two_phase``: the shards padded to R chunks of S; owner j sums chunk j of every
    replica (compressed; its own exact in quant mode, as FULL_SHARD's transport
    keeps it), then its sum is compressed again (quant: coded on the owner's code,
    ``hsdp_out_format``: ``int4`` after ternary/sign; sparse/auto: top k of S;
    exact/paper: sent losslessly) and every replica takes owner j's chunk from it.
    """
    from test_quant import owner_format_ref

    n, length = len(every), every[0].numel()
    if form == "gather":
        want = torch.zeros_like(every[0])
        for e in every:  # replica order, as the hook sums
            want += _compress_ref(e, cfg)
        return want
    s = math.ceil(length / n)
    padded = [torch.nn.functional.pad(e, (0, n * s - length)) for e in every]
    chunks = []
    for j in range(n):
        acc = torch.zeros(s)
        for r in range(n):
            c = padded[r][j * s:(j + 1) * s]
            acc += c if cfg.mode == "quant" and r == j else _compress_ref(c, cfg)
        out = owner_format_ref(cfg.quant_format, cfg.hsdp_out_format) \
            if cfg.mode == "quant" else ""
        chunks.append(acc if cfg.mode in ("exact", "paper") else _compress_ref(acc, cfg, out))
    return torch.cat(chunks)[:length]


def _reference(rank: int, n: int, cfg: tagc.TAGCConfig, shape: Tuple[int, int] = (R, S),
               form: str = "") -> int:
    """Each compressed unit's hook output against :func:`reference_allreduce` (of the
    form the reducer took, which must be ``form`` when given)."""
    from tagc.hsdp import TwoPhaseReducer

    mesh = _mesh(*shape)
    model, state = _tagc_model(cfg, mesh)
    seen = _tap(state)
    _step(model, rank, 0)
    group = mesh.get_group("replicate")
    checked = 0
    for u in state.units:
        if not u.compressed:
            continue
        took = "two_phase" if isinstance(u, TwoPhaseReducer) else "gather"
        assert took == (form or took), (u.name, took, form)
        x, got = seen[u.name]
        every = [torch.empty_like(x) for _ in range(shape[0])]
        dist.all_gather(every, x, group=group)
        want = reference_allreduce(every, cfg, took)
        if cfg.mode == "quant":
            assert torch.equal(got, want), (u.name, float((got - want).abs().max()))
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        checked += 1
    assert checked
    return checked


def _owed(u: Any, group: Any) -> torch.Tensor:
    """What the replicas still owe of a unit's sum (float64, the shard's length): their
    residuals summed, and with two-phase each owner's ``residual_out`` at its chunk."""
    res = u.residual.double().clone()
    dist.all_reduce(res, group=group)
    out = getattr(u, "residual_out", None)
    if out is not None:
        every = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, out, group=group)
        res += torch.cat(every).double()
    return res[:u.shard_numel]


def _conservation(rank: int, n: int, cfg: tagc.TAGCConfig,
                  shape: Tuple[int, int] = (R, S), owes: bool = True) -> Dict[str, Any]:
    """Over steps: the replicas' sum of what they sent + what they owe (residuals; with
    two-phase also the owners' ``residual_out``) == the sum of their inputs (each
    hook output is that sent sum, the same on every replica)."""
    mesh = _mesh(*shape)
    model, state = _tagc_model(cfg, mesh)
    seen = _tap(state)
    group = mesh.get_group("replicate")
    raw: Dict[str, torch.Tensor] = {}
    out: Dict[str, torch.Tensor] = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        _step(model, rank, step)
        for name, (x, y) in seen.items():
            raw[name] = raw.get(name, 0) + x.double()
            out[name] = out.get(name, 0) + y.double()
        opt.step()
        opt.zero_grad()
    for u in state.units:
        if not u.compressed:
            continue
        tot = raw[u.name].clone()
        dist.all_reduce(tot, group=group)
        res = _owed(u, group)
        err = float((out[u.name] + res - tot).abs().max())
        assert err <= 1e-5 * float(tot.abs().max()), (cfg.mode, u.name, err)
        if cfg.mode != "quant" and owes:  # (a bypassed last step settles all)
            assert float(res.abs().max()) > 0
    return state.stats()["total"]


def _ef21_agrees(rank: int, n: int) -> None:
    """EF21: every replica's estimate equals the sum over replicas of their -residual."""
    cfg = _cfg("quant", quant_format="ternary", ef21=True)
    mesh = _mesh()
    model, state = _tagc_model(cfg, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        _step(model, rank, step)
        opt.step()
        opt.zero_grad()
    for u in state.units:
        if u.compressed:
            h = (-u.residual).double()
            dist.all_reduce(h, group=mesh.get_group("replicate"))
            assert float((u.estimate.double() - h).abs().max()) <= 1e-5 * float(h.abs().max())


def _nonfinite(rank: int, n: int, shape: Tuple[int, int] = (R, S)) -> None:
    """A NaN on one rank: every replica takes the plain all-reduce for every compressed
    unit, the feedback state stays as it was, and the NaN reaches the gradients."""
    mesh = _mesh(*shape)
    model, state = _tagc_model(_cfg("sparse", theta=0.9), mesh)
    _step(model, rank, 0)
    comp = [u for u in state.units if u.compressed]
    before = {u.name: u.residual.clone() for u in comp}
    model.zero_grad()
    loss = model(toy_batch(rank, 1))
    (loss * float("nan") if rank == 0 else loss).backward()
    for u in comp:
        assert torch.equal(u.residual, before[u.name]), u.name
    assert state.stats()["total"]["nonfinite_fallbacks"] == len(comp)
    assert not all(bool(torch.isfinite(g).all()) for g in local_grads(model))


def _raises(exc: type, match: str, fn: Any, *args: Any, **kw: Any) -> str:
    """``fn(*args, **kw)`` must raise ``exc`` with ``match`` in its message; returns it.
    Not pytest.raises: its failure is a BaseException, which would end the shared
    spawn's other cases too (run_cases isolates Exceptions)."""
    try:
        fn(*args, **kw)
    except exc as e:
        assert match in str(e), (match, str(e))
        return str(e)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc.__name__}")


def _bad_mesh(rank: int, n: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    bad = init_device_mesh("cpu", (R, S), mesh_dim_names=("shard", "replicate"))
    _raises(ValueError, "mesh_dim_names", tagc.shard_model, ToyGPT(), _cfg("exact"), mesh=bad)
    native = _native(_cfg("exact"), _mesh())
    msg = _raises(ValueError, "native HSDP", tagc.register, native, _cfg("exact"))
    # the mesh is register's argument: without it nothing would sum over the
    # replicas; a plain FSDP2 model is not sharded over a mesh's "shard" dimension
    torch.manual_seed(0)
    model = tagc.shard_model(ToyGPT(), _cfg("exact"), mesh=_mesh())
    _raises(ValueError, "mesh=mesh", tagc.register, model, _cfg("exact"))
    plain = tagc.shard_model(ToyGPT(), _cfg("exact"))
    _raises(ValueError, "not sharded over this mesh", tagc.register, plain, _cfg("exact"),
            mesh=_mesh())
    state = tagc.register(model, _cfg("exact"), mesh=_mesh())  # nothing was hooked before
    _step(model, rank, 0)
    assert state.stats()["total"]["compressed_calls"] > 0
    return msg


def _replicas_agree(rank: int, n: int, cfg: tagc.TAGCConfig, steps: int = 3,
                    shape: Tuple[int, int] = (R, S)) -> int:
    """Every step, each compressed unit's hook output (the decoded sum over the
    replicas) is the same on both replicas bit for bit, and so are the parameters
    after the optimizer steps: the replicas must not drift apart.

    Args:
        rank: global rank.
        n: world size (R x S).
        cfg: a compressing config.
        steps: optimizer steps.
        shape: (replicas, shards).
    Returns:
        how many (step, unit) outputs were compared.
    """
    mesh = _mesh(*shape)
    group = mesh.get_group("replicate")
    model, state = _tagc_model(cfg, mesh)
    seen = _tap(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compared = 0
    for step in range(steps):
        _step(model, rank, step)
        opt.step()
        opt.zero_grad()
        for u in state.units:
            if not u.compressed:
                continue
            got = seen[u.name][1]
            every = [torch.empty_like(got) for _ in range(shape[0])]
            dist.all_gather(every, got, group=group)
            assert all(torch.equal(every[0], e) for e in every[1:]), (
                cfg.mode, step, u.name, float((every[0] - every[1]).abs().max()))
            compared += 1
    assert state.stats()["total"]["compressed_calls"] > 0
    mine = torch.cat([p.reshape(-1) for p in _params(model)])
    every = [torch.empty_like(mine) for _ in range(shape[0])]
    dist.all_gather(every, mine, group=group)
    assert all(torch.equal(every[0], e) for e in every[1:]), cfg.mode
    return compared


def _bypass(rank: int, n: int, cfg: tagc.TAGCConfig, shape: Tuple[int, int] = (R, S)) -> int:
    """bypass_every on custom HSDP (the same reducer as FULL_SHARD): both paths are
    taken, nothing owed is lost (conservation over the steps, bypassed ones
    included) and the replicas agree bit for bit."""
    st = _conservation(rank, n, cfg, shape, owes=False)
    assert st["bypassed_calls"] > 0 and st["compressed_calls"] > 0, st
    _replicas_agree(rank, n, cfg, 4, shape)
    return int(st["bypassed_calls"])


def _overlap_pair(cfg: tagc.TAGCConfig, shape: Tuple[int, int]) -> Tuple[Any, Any, Any, Any]:
    """The same model registered twice on one mesh: overlapped (the default) and
    blocking (``hsdp_overlap=False``)."""
    mesh = _mesh(*shape)
    ov, ov_state = _tagc_model(cfg, mesh)
    cfg_b = dataclasses.replace(cfg, hsdp_overlap=False)
    blk, blk_state = _tagc_model(cfg_b, mesh)
    assert ov_state._overlap is not None and blk_state._overlap is None
    return ov, ov_state, blk, blk_state


def _overlap_equals_blocking(rank: int, n: int, cfg: tagc.TAGCConfig,
                             shape: Tuple[int, int] = (R, S)) -> int:
    """With the all-reduce overlapped, every step's gradients (as backward() returns
    them), the parameters after the optimizer and the feedback state are the blocking
    hook's bit for bit; the units really ran on the worker and none is in flight
    when backward() returns.  Then gradient accumulation (a second backward into
    existing ``.grad``s) blocks every unit and still equals the blocking hook.

    Returns:
        units the worker ran.
    """
    ov, ov_state, blk, blk_state = _overlap_pair(cfg, shape)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ov, blk)]
    for step in range(3):
        for m in (ov, blk):
            _step(m, rank, step)
            assert ov_state._overlap.pending == 0
        for i, (a, b) in enumerate(zip(local_grads(ov), local_grads(blk))):
            assert torch.equal(a, b), (cfg.mode, step, i, float((a - b).abs().max()))
        for o in opts:
            o.step()
            o.zero_grad()
        if step == 0:
            held0 = ov_state._streams.scratch.nbytes
    deferred = ov_state._overlap.deferred
    assert deferred == 3 * len(ov_state.units), (deferred, len(ov_state.units))
    for a, b in zip(_params(ov), _params(blk)):
        assert torch.equal(a, b), cfg.mode
    for ua, ub in zip(ov_state.units, blk_state.units):
        for name, _, _ in ua.feedback_buffers():
            x, y = getattr(ua, name), getattr(ub, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    # the reused CPU buffers (tagc.device.Scratch) stop growing after the first step
    held = ov_state._streams.scratch.nbytes
    assert held0 > 0 and held == held0 == blk_state._streams.scratch.nbytes, (held0, held)
    for step in (3, 4):  # accumulate: the second backward finds every .grad set
        for m in (ov, blk):
            _step(m, rank, step)
    assert ov_state._overlap.deferred == deferred + len(ov_state.units)
    for i, (a, b) in enumerate(zip(local_grads(ov), local_grads(blk))):
        assert torch.equal(a, b), ("accumulated", i, float((a - b).abs().max()))
    assert ov_state.stats()["total"]["calls"] == blk_state.stats()["total"]["calls"]
    return deferred


def _overlap_error(rank: int, n: int) -> None:
    """A unit failing on the worker fails that backward with a clear error, on every
    rank alike, and stops the worker: the units queued behind it never ran, and every
    later hook call fails at once with the first error instead of pairing collectives
    wrongly."""
    cfg = _cfg("quant", quant_format="int4")
    model, state = _tagc_model(cfg, _mesh())
    victim = state.units[0]

    def broken(t: torch.Tensor) -> None:
        raise ValueError("injected")

    victim._all_reduce = broken
    try:
        _step(model, rank, 0)
    except RuntimeError as e:
        assert "overlapped HSDP all-reduce failed" in str(e)
        assert isinstance(e.__cause__, ValueError), repr(e.__cause__)
    else:
        raise AssertionError("backward() returned despite a failed all-reduce")
    assert state._overlap.pending == 0 and state._overlap.failed
    calls = [u.stats_dict()["calls"] for u in state.units]
    assert calls[0] == 0 and 0 < sum(calls) < len(calls) - 1, calls
    # the worker keeps reporting the first error to the next hook call (a next step
    # itself is not run here: its FSDP gathers would race the peers' exits, and
    # tests/test_failures.py drives the worker past a failure directly)
    for _ in range(2):
        try:
            state._overlap.run(lambda: None, "HSDP all-reduce")
        except RuntimeError as e:
            assert "overlapped HSDP all-reduce failed: injected" in str(e), str(e)
            assert isinstance(e.__cause__, ValueError), repr(e.__cause__)
        else:
            raise AssertionError("the worker took a job after its failure")
    assert [u.stats_dict()["calls"] for u in state.units] == calls


CASES = [
    ("dense_equals_native", _dense_equals_native),
    ("exact_reference", lambda r, n: _reference(r, n, _cfg("exact", theta=0.9,
                                                         error_feedback=False))),
    ("sparse_reference", lambda r, n: _reference(r, n, _cfg("sparse", theta=0.9,
                                                          error_feedback=False))),
    ("auto_reference", lambda r, n: _reference(r, n, _cfg("auto", theta=0.9,
                                                        error_feedback=False))),
    ("auto_bitmap_reference", lambda r, n: _reference(r, n, _cfg("auto", theta=0.5,
                                                               error_feedback=False))),
    ("quant_reference", lambda r, n: _reference(r, n, _cfg("quant", quant_format="int4",
                                                         error_feedback=False))),
    ("exact_recovery_reference", lambda r, n: _reference(
        r, n, _cfg("exact", theta=0.5, sketch_factor=0.5, error_feedback=False))),
    ("ef_exact", lambda r, n: _conservation(r, n, _cfg("exact", theta=0.9))),
    ("ef_sparse", lambda r, n: _conservation(r, n, _cfg("sparse", theta=0.9))),
    ("ef_auto", lambda r, n: _conservation(r, n, _cfg("auto", theta=0.9875))),
    # the whole residual fed back (residual_factor 1): what is owed is conserved
    ("ef_quant", lambda r, n: _conservation(
        r, n, _cfg("quant", quant_format="ternary", residual_factor=1.0))),
    ("ef21_agrees", _ef21_agrees),
    ("nonfinite", _nonfinite),
    ("bad_mesh", _bad_mesh),
    ("bypass_gather", lambda r, n: _bypass(r, n, _cfg("auto", theta=0.9, bypass_every=2))),
    ("bypass_two_phase", lambda r, n: _bypass(
        r, n, _cfg("quant", quant_format="ternary", bypass_every=2,
                   hsdp_allreduce="two_phase", residual_factor=1.0))),
    # with feedback and lossy or peeled sums: what could differ between replicas
    ("replicas_agree_exact", lambda r, n: _replicas_agree(
        r, n, _cfg("exact", theta=0.5, sketch_factor=0.5))),
    ("replicas_agree_paper", lambda r, n: _replicas_agree(
        r, n, _cfg("paper", theta=0.8, ratio=2, index_bits=1))),
    ("replicas_agree_auto", lambda r, n: _replicas_agree(r, n, _cfg("auto", theta=0.9))),
    ("replicas_agree_quant_ef21", lambda r, n: _replicas_agree(
        r, n, _cfg("quant", quant_format="ternary", ef21=True))),
    # hsdp_overlap: the worker thread gives the blocking hook's values
    ("overlap_quant_ef21", lambda r, n: _overlap_equals_blocking(
        r, n, _cfg("quant", quant_format="ternary", ef21=True, hsdp_allreduce="two_phase"))),
    ("overlap_exact", lambda r, n: _overlap_equals_blocking(
        r, n, _cfg("exact", theta=0.5, sketch_factor=0.5))),
    ("overlap_error", _overlap_error),
]


def _suite(rank: int, n: int) -> Dict[str, Any]:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("tagc_hook").setLevel(logging.ERROR)
    return run_cases(rank, n, CASES)


SPAWN = SharedSpawn(_suite, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_hsdp(case: str) -> None:
    """One case (all cases share one 4-process spawn)."""
    SPAWN.case(R * S, case)


# ------------------------------------------------------------- R = 3, 4 (1 rank per node)

def _bytes(rank: int, n: int) -> Dict[str, float]:
    """Wire bytes per rank of one compressed unit's all-reduce, counted by stats():
    two-phase sends (R-1) coded chunks to their owners and (R-1) copies of its coded
    chunk of the sum, the all-gather form (R-1) copies of its coded shard (quant
    codes: sizes from ``_tagc.quant_bytes``)."""
    from tagc.transports import _tagc

    got = {}
    for form, fmt in (("two_phase", "int4"), ("gather", "int4"), ("two_phase", "ternary")):
        cfg = _cfg("quant", quant_format=fmt, hsdp_allreduce=form)
        model, state = _tagc_model(cfg, _mesh(n, 1))
        _step(model, rank, 0)
        u = next(u for u in state.units if u.compressed)
        st = state.stats()["units"][u.name]
        # the control messages (the non-finite vote) are all-reduces: 2(R-1)/R on the wire
        data = st["wire_bytes"] - 2 * (n - 1) / n * st["control_bytes"]
        s = math.ceil(u.shard_numel / n)
        # two-phase: chunks to their owners on quant_format, the owner's sum on its
        # code (int4 after ternary)
        b = cfg.quant_block
        want = (n - 1) * (_tagc.quant_bytes(s, fmt, b) + _tagc.quant_bytes(s, "int4", b)) \
            if form == "two_phase" else (n - 1) * _tagc.quant_bytes(u.shard_numel, fmt, b)
        assert data == want, (form, fmt, data, want)
        got[f"{form}_{fmt}"] = data
    return got


def _replica_cases(n: int) -> List[Tuple[str, Any]]:
    shape = (n, 1)
    return [
        ("dense_equals_native", lambda r, w: _dense_equals_native(r, w, shape)),
        ("quant_reference", lambda r, w: _reference(
            r, w, _cfg("quant", quant_format="int4", error_feedback=False), shape,
            "two_phase")),
        ("quant_ternary_reference", lambda r, w: _reference(
            r, w, _cfg("quant", quant_format="ternary", error_feedback=False,
                       hsdp_allreduce="two_phase"), shape, "two_phase")),
        ("quant_ternary_auto_reference", lambda r, w: _reference(
            r, w, _cfg("quant", quant_format="ternary", error_feedback=False), shape)),
        ("quant_gather_reference", lambda r, w: _reference(
            r, w, _cfg("quant", error_feedback=False, hsdp_allreduce="gather"), shape,
            "gather")),
        ("sparse_reference", lambda r, w: _reference(
            r, w, _cfg("sparse", theta=0.9, error_feedback=False), shape, "two_phase")),
        ("auto_reference", lambda r, w: _reference(
            r, w, _cfg("auto", theta=0.5, error_feedback=False), shape, "two_phase")),
        ("exact_reference", lambda r, w: _reference(
            r, w, _cfg("exact", theta=0.9, error_feedback=False), shape, "two_phase")),
        ("ef_quant", lambda r, w: _conservation(
            r, w, _cfg("quant", quant_format="ternary", residual_factor=1.0), shape)),
        ("ef_sparse", lambda r, w: _conservation(r, w, _cfg("sparse", theta=0.9), shape)),
        ("replicas_agree_quant_ef21", lambda r, w: _replicas_agree(
            r, w, _cfg("quant", quant_format="ternary", ef21=True), 3, shape)),
        ("replicas_agree_paper", lambda r, w: _replicas_agree(
            r, w, _cfg("paper", theta=0.8, ratio=2, index_bits=1), 3, shape)),
        ("bypass_two_phase", lambda r, w: _bypass(
            r, w, _cfg("auto", theta=0.9, bypass_every=2), shape)),
        ("nonfinite", lambda r, w: _nonfinite(r, w, shape)),
        ("bytes", _bytes),
    ]


def _replica_suite(rank: int, n: int) -> Dict[str, Any]:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("tagc_hook").setLevel(logging.ERROR)
    return run_cases(rank, n, _replica_cases(n))


REPLICA_SPAWN = SharedSpawn(_replica_suite, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [3, 4])
@pytest.mark.parametrize("case", [c for c, _ in _replica_cases(3)])
def test_hsdp_replicas(replicas: int, case: str) -> None:
    """R = 3 and 4 nodes of 1 rank: the two-phase all-reduce against the test's own
    compress -> sum -> compress (and the all-gather form's), conservation with both
    feedback states, replica agreement, the bypass, and the bytes (one spawn per R)."""
    REPLICA_SPAWN.case(replicas, case)


# --------------------------------------------------------------------------- resume

def _params(model: Any) -> List[torch.Tensor]:
    return [p._local_tensor.clone() if hasattr(p, "_local_tensor") else p.data.clone()
            for p in model.parameters()]


def _train(rank: int, model: Any, opt: Any, steps: range) -> None:
    for i in steps:
        _step(model, rank, i)
        opt.step()
        opt.zero_grad()


RESUME_CFGS = {  # the all-gather form, and two-phase with all three feedback states
    "sparse_gather": dict(mode="sparse", theta=0.9),
    "ternary_ef21_two_phase": dict(mode="quant", quant_format="ternary", ef21=True,
                                   hsdp_allreduce="two_phase"),
    # both residuals (to the owner, and the owner's to everyone) kept as int8 codes
    "int4_rcode_two_phase": dict(mode="quant", quant_format="int4", ef21=False,
                                 residual_code="int8", hsdp_allreduce="two_phase"),
}


def _resume_first(rank: int, n: int, tmp: str) -> None:
    for which in RESUME_CFGS:
        os.makedirs(os.path.join(tmp, which), exist_ok=True)
        _resume_first_one(rank, os.path.join(tmp, which), which)


def _resume_first_one(rank: int, tmp: str, which: str) -> None:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    cfg = _cfg(**RESUME_CFGS[which])
    model, state = _tagc_model(cfg, _mesh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(rank, model, opt, range(6))
    torch.save(_params(model), os.path.join(tmp, f"straight-{rank}.pt"))
    model, state = _tagc_model(cfg, _mesh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(rank, model, opt, range(3))
    torch.save({"params": _params(model), "tagc": state.state_dict()},
               os.path.join(tmp, f"ck-{rank}.pt"))
    dcp.save({"tagc": state}, checkpoint_id=os.path.join(tmp, "dcp"))


def _resume_second(rank: int, n: int, tmp: str) -> Dict[str, List[bool]]:
    return {which: _resume_second_one(rank, os.path.join(tmp, which), which)
            for which in RESUME_CFGS}


def _resume_second_one(rank: int, tmp: str, which: str) -> List[bool]:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    cfg = _cfg(**RESUME_CFGS[which])
    straight = torch.load(os.path.join(tmp, f"straight-{rank}.pt"), weights_only=True)
    same = []
    for how in ("torch", "dcp", None):
        model, state = _tagc_model(cfg, _mesh())
        ck = torch.load(os.path.join(tmp, f"ck-{rank}.pt"), weights_only=True)
        with torch.no_grad():
            for p, saved in zip(model.parameters(), ck["params"]):
                (p._local_tensor if hasattr(p, "_local_tensor") else p.data).copy_(saved)
        if how == "torch":
            state.load_state_dict(ck["tagc"])
        elif how == "dcp":
            dcp.load({"tagc": state}, checkpoint_id=os.path.join(tmp, "dcp"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(rank, model, opt, range(3, 6))
        same.append(all(torch.equal(a, b) for a, b in zip(_params(model), straight)))
    return same


_RESUMED: Dict[str, List[Dict[str, List[bool]]]] = {}  # both configs: one pair of spawns


@pytest.mark.slow
@pytest.mark.parametrize("which", list(RESUME_CFGS))
def test_hsdp_resume_in_new_processes(which: str) -> None:
    """6 steps == 3 steps + checkpoint + new processes + load + 3 steps, bit for bit,
    both ways; without loading the TAGC state the parameters differ."""
    if "res" not in _RESUMED:
        with tempfile.TemporaryDirectory() as tmp:
            run_dist(_resume_first, R * S, tmp, timeout=300)
            _RESUMED["res"] = run_dist(_resume_second, R * S, tmp, timeout=300)
    res = [r[which] for r in _RESUMED["res"]]
    assert all(r == [True, True, False] for r in res), res
