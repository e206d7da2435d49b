"""End-to-end TAGC hook on CUDA in one process (issue 6, item 5).

One rank, NCCL, a small bias-free MLP sharded with FSDP2 by
``tagc.shard_model`` (each Linear weight its own unit) and ``tagc.register``.
FSDP never calls a reduce-scatter on one rank, so the codec path is driven
through the comm objects register() installed, exactly as FSDP2 calls them
on more ranks (on a side stream).  With one rank every mode sends the kept
entries losslessly, so the output must be the top-k (by |g + r|, ties to the
lower position) of gradient plus error-feedback residual, over several steps.
Also: device-side counters reach stats(), a non-finite gradient reaches the
output and leaves the residual untouched (sync-free on CUDA), the comm
enqueues no host sync (issue 6 item 3), and a full FSDP2 training step on
one rank keeps plain gradients.

Skipped without a CUDA device or a CUDA build of ``_tagc``.
``TAGC_CUDA_TEST_DEVICE=cpu`` runs the same harness on CPU with gloo (a
self-check of this file, not of CUDA).
"""
from __future__ import annotations

import copy
import datetime
import math
from typing import Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

_tagc = pytest.importorskip("_tagc")
tagc = pytest.importorskip("tagc_hook")
from cuda_helpers import DEV, needs_cuda
from tagc import fsdp2

pytestmark = [needs_cuda(_tagc), pytest.mark.cuda, pytest.mark.codec]

THETA = 0.9
IN, HID, OUT, BATCH = 48, 160, 40, 16


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank default process group (NCCL on CUDA, gloo for the self-check)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = tmp_path_factory.mktemp("pg") / "store"
    backend = "nccl" if DEV == "cuda" else "gloo"
    if DEV == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID, bias=False), nn.ReLU(),
                         nn.Linear(HID, OUT, bias=False)).to(DEV)


def topk_split(v: torch.Tensor, k: int) -> torch.Tensor:
    """v where among the k largest |v| (ties: lower position), else 0."""
    key = v.abs()
    # Sort by magnitude descending, position ascending: exact tie rule.
    order = sorted(range(v.numel()), key=lambda i: (-float(key[i]), i))[:k]
    keep = torch.zeros(v.numel(), dtype=torch.bool, device=v.device)
    keep[torch.tensor(order, dtype=torch.long, device=v.device)] = True
    return torch.where(keep, v, torch.zeros_like(v))


def residuals(state: "tagc.TAGCState") -> Dict[str, torch.Tensor]:
    """This rank's residual rows, as checkpointed (CPU copies)."""
    return {name: u["residual"].to_local().reshape(-1)
            for name, u in state.state_dict()["units"].items() if u.get("has_residual")}


def installed_comms(model: nn.Module) -> List[tuple]:
    """(comm, group) of every FSDP2 unit, where register() installed them.

    FSDP (both versions) never calls a reduce-scatter on one rank (FSDP1
    switches to NO_SHARD, FSDP2 copies the gradient), so a one-process test
    drives the installed comm itself, as FSDP2 would on more ranks:
    ``comm(output_tensor=, input_tensor=, group=, op=SUM)`` on its stream.
    """
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for pg in fsdp2.param_groups(m):
                out.append((pg._reduce_scatter_comm, pg.mesh_info.shard_process_group))
    return out


def call_on_side_stream(comm, out: torch.Tensor, g: torch.Tensor, pg) -> None:  # noqa: ANN001
    """Call the comm as FSDP2 does: on its reduce-scatter stream (CUDA)."""
    if DEV == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            comm(output_tensor=out, input_tensor=g, group=pg, op=dist.ReduceOp.SUM)
        torch.cuda.current_stream().wait_stream(stream)
    else:
        comm(output_tensor=out, input_tensor=g, group=pg, op=dist.ReduceOp.SUM)


def unit_stats(state: "tagc.TAGCState", numel: int) -> dict:
    units = [v for v in state.stats()["units"].values() if v["numel"] == numel]
    assert len(units) == 1
    return units[0]


def sharded(cfg: "tagc.TAGCConfig") -> tuple:
    model = tagc.shard_model(make_model(0), cfg)
    state = tagc.register(model, cfg)
    comms = installed_comms(model)
    assert len(comms) == 2  # the two Linear weights; the root holds nothing
    return state, comms


def first_unit(mode: str, theta: float, seed: int) -> tuple:
    """(state, comm, group, numel, k) of the first Linear's unit."""
    cfg = tagc.TAGCConfig(mode=mode, theta=theta, min_numel=1024, seed=seed,
                          layers="non_attention", ef21=False)
    state, comms = sharded(cfg)
    comm, pg = comms[0]
    numel = IN * HID
    k = min(max(math.ceil(round((1.0 - theta) * numel, 9)), 1), numel)
    return state, comm, pg, numel, k


def unit_residual(state: "tagc.TAGCState", numel: int) -> torch.Tensor:
    res = [t for t in residuals(state).values() if t.numel() == numel]
    assert len(res) == 1
    return res[0].float()


@pytest.mark.parametrize("mode,theta", [("exact", THETA), ("sparse", THETA),
                                        ("paper", 0.9875)])
def test_comm_one_rank_is_topk_with_error_feedback(group: None, mode: str,
                                                   theta: float) -> None:
    # One rank: the union is the rank's own kept set, and each mode sends it
    # losslessly (paper's 10x sketch holds 8 buckets per kept entry here), so
    # the output must be exactly top-k(g + r) and the residual the rest.
    state, comm, pg, numel, k = first_unit(mode, theta, seed=3)
    r = torch.zeros(numel, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(1)
    for step in range(3):
        g = torch.randn(numel, device=DEV, generator=gen)
        out = torch.full((numel,), float("nan"), device=DEV)
        call_on_side_stream(comm, out, g, pg)
        v = g + r
        want = topk_split(v, k)
        r = v - want
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    torch.testing.assert_close(unit_residual(state, numel), r.to("cpu"), rtol=1e-5, atol=1e-6)
    # On CUDA these counters live on the device until stats() reads them.
    st = unit_stats(state, numel)
    assert (st["calls"], st["compressed_calls"], st["nonfinite_fallbacks"]) == (3, 3, 0)
    per_call = 0 if mode == "sparse" else k  # sparse mode has no union to measure
    assert st["union_size"] == 3 * per_call and st["shard_slots"] == 3 * numel
    assert st["unpeeled"] == 0 and st["collision_dropped"] == 0


@pytest.mark.parametrize("mode,theta", [("exact", THETA), ("sparse", THETA),
                                        ("paper", 0.9875)])
def test_comm_nonfinite_keeps_residual_and_reaches_output(group: None, mode: str,
                                                          theta: float) -> None:
    # A non-finite gradient must reach the output (GradScaler skips the step)
    # and leave the residual as it was, so the next finite step is top-k of
    # g + the residual from before.  On CUDA the flag is never read on the
    # host (poisoned shards, tagc_hook._poison_nonfinite); on CPU the plain path.
    state, comm, pg, numel, k = first_unit(mode, theta, seed=5)
    gen = torch.Generator(device=DEV).manual_seed(2)
    g1 = torch.randn(numel, device=DEV, generator=gen)
    out = torch.empty(numel, device=DEV)
    call_on_side_stream(comm, out, g1, pg)
    r1 = g1 - topk_split(g1, k)
    g2 = torch.randn(numel, device=DEV, generator=gen)
    g2[numel // 2] = float("inf")
    call_on_side_stream(comm, out, g2, pg)
    assert not torch.isfinite(out).all()
    torch.testing.assert_close(unit_residual(state, numel), r1.to("cpu"), rtol=1e-5, atol=1e-6)
    g3 = torch.randn(numel, device=DEV, generator=gen)
    call_on_side_stream(comm, out, g3, pg)
    torch.testing.assert_close(out, topk_split(g3 + r1, k), rtol=1e-5, atol=1e-6)
    st = unit_stats(state, numel)
    assert (st["calls"], st["compressed_calls"], st["nonfinite_fallbacks"]) == (3, 2, 1)
    assert st["shard_slots"] == 2 * numel  # the non-finite call's sizes are dropped
    if mode != "sparse":  # and its device counts
        assert st["union_size"] == 2 * k


@pytest.mark.skipif(DEV != "cuda", reason="host-sync detection is CUDA-only")
@pytest.mark.parametrize("mode", ["exact", "sparse", "paper"])
def test_comm_enqueues_no_host_sync(group: None, mode: str) -> None:
    # docs/DESIGN.md section 2 / issue 6 item 3: the codec and the exchange are
    # stream-ordered; a .item() or synchronize in the hook would stall the CPU
    # once per unit and serialise it with FSDP's all-gather prefetch.
    theta = 0.9875 if mode == "paper" else THETA
    cfg = tagc.TAGCConfig(mode=mode, theta=theta, min_numel=1024, layers="non_attention",
                          ef21=False)
    _, comms = sharded(cfg)
    comm, pg = comms[0]
    g = torch.randn(IN * HID, device=DEV)
    out = torch.empty_like(g)
    comm(output_tensor=out, input_tensor=g, group=pg, op=dist.ReduceOp.SUM)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        comm(output_tensor=out, input_tensor=g, group=pg, op=dist.ReduceOp.SUM)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


def test_fsdp2_one_rank_trains(group: None) -> None:
    # FSDP2 never calls the custom reduce-scatter on one rank (it copies the
    # gradient), so this checks that registering on CUDA leaves training
    # correct: gradients equal the plain model's.
    cfg = tagc.TAGCConfig(mode="exact", theta=THETA, min_numel=1024, layers="non_attention",
                          ef21=False)
    ref = make_model(0)
    model = tagc.shard_model(copy.deepcopy(ref), cfg)
    tagc.register(model, cfg)
    x = torch.randn(BATCH, IN, device=DEV)
    ref(x).square().mean().backward()
    model(x).square().mean().backward()
    for w, p in zip([ref[0].weight, ref[2].weight], model.parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, w.grad, rtol=1e-5, atol=1e-6)
