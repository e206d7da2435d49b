"""TAGC's compressed all-reduce inside torchft (tagc/ft.py, docs/TORCHFT.md).

Replicas are threads of this process, as in torchft's own integration tests, each
with torchft's reconfigurable gloo group.  :class:`Quorums` plays the Lighthouse: it
configures every member's group for a quorum (a fresh store prefix per quorum, as the
``Manager`` does) and decides each step's commit from the members' errors, which
:class:`StubManager` (the public ``Manager`` methods FTAllReduce reads) reports.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft", reason="torchft not installed (pip install tagc[ft])")
from torchft.process_group import ProcessGroupGloo  # noqa: E402

from ft_helpers import Quorums, Replica  # noqa: E402

from tagc.codec import _tagc  # noqa: E402
from tagc.config import TAGCConfig  # noqa: E402
from tagc.device import CodecStreams  # noqa: E402
from tagc.ft import FTAllReduce, FTManager, build_reducer, carry_feedback  # noqa: E402
from tagc.memory import coded_bytes  # noqa: E402

pytestmark = pytest.mark.codec

L = 1000  # not a multiple of 2 or 3: the two-phase form pads


def owed(r: Replica, key: Any = "g") -> torch.Tensor:
    """What replica ``r`` owes, in sum space: its residual plus its residual_out
    folded at its chunk (fp32 residuals: ``residual_code`` none)."""
    u = r.ft.units.get(key)
    total = torch.zeros(L)
    if u is None or u.residual is None:
        return total
    total += u.residual.float()[:L]
    out = getattr(u, "residual_out", None)
    if out is not None:
        start = u.rank * u.chunk
        stop = min(start + u.chunk, L)
        total[start:stop] += out.float()[:stop - start]
    return total


def grads_for(n: int, seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(L, generator=g) for _ in range(n)]


def test_two_replicas_dense_is_the_exact_mean_and_quant_conserves() -> None:
    """(a) dense: bit for bit the mean; quant (all-gather form at R = 2): bit-equal on
    both replicas, near the mean, and nothing lost: the outputs times R plus what each
    replica owes equal every input summed, step after step."""
    q = Quorums()
    dense = [Replica(TAGCConfig(mode="dense")) for _ in range(2)]
    q.form(dense, 0)
    a, b = grads_for(2, 0)
    outs = q.sync([a, b])
    assert torch.equal(outs[0], (a + b) / 2) and torch.equal(outs[1], outs[0])
    assert q.commit()

    # the whole residual fed back (residual_factor 1): nothing owed is dropped
    cfg = TAGCConfig(mode="quant", residual_code="none", residual_factor=1.0)
    reps = [Replica(cfg) for _ in range(2)]
    q.form(reps, 0)
    sent = torch.zeros(L)
    given = torch.zeros(L)
    for step in range(3):
        grads = grads_for(2, 10 + step)
        outs = q.sync(grads)
        assert q.commit()
        assert torch.equal(outs[0], outs[1])
        mean = (grads[0] + grads[1]) / 2
        # int4 blocks: a few hundredths of the spread, never the spread itself
        assert 0 < (outs[0] - mean).abs().max() < 0.5
        sent += 2 * outs[0]
        given += grads[0] + grads[1]
        torch.testing.assert_close(sent + owed(reps[0]) + owed(reps[1]), given,
                                   rtol=0, atol=1e-4)
    st = reps[0].ft.stats()["g"]
    assert (st["replicas"], st["rank"], st["form"]) == (2, 0, "gather")
    assert st["compressed_calls"] == 3


def test_quorum_two_one_two_follows_and_the_joiner_starts_at_zero() -> None:
    """(b) R 2 -> 1 -> 2, two-phase: the exchange follows R; alone, the tensor is its
    own mean and the state waits untouched; the leaver comes back healed, its old
    residual dropped (zero), ranks swapped, so the survivor's state is carried to the
    new chunks; across it all, nothing owed is lost or counted twice."""
    cfg = TAGCConfig(mode="quant", residual_code="none", residual_factor=1.0,
                     hsdp_allreduce="two_phase")
    a, b = Replica(cfg), Replica(cfg)
    q = Quorums()
    q.form([a, b], 0)
    sent, given = torch.zeros(L), torch.zeros(L)
    for step in range(2):
        grads = grads_for(2, 20 + step)
        outs = q.sync(grads)
        assert q.commit()
        sent += 2 * outs[0]
        given += grads[0] + grads[1]
    stale_b = owed(b)
    assert stale_b.abs().sum() > 0 and a.ft.stats()["g"]["replicas"] == 2
    assert a.ft.units["g"].residual_out is not None  # the owner's state exists

    q.form([a], 2)  # b fails
    before = a.ft.feedback_state("g")
    calls = a.ft.stats()["g"]["calls"]
    (g,) = grads_for(1, 30)
    (out,) = q.sync([g])
    assert q.commit()
    assert torch.equal(out, g)
    after = a.ft.feedback_state("g")
    assert all(torch.equal(before[k], after[k]) for k in before if before[k] is not None)
    assert a.ft.stats()["g"]["calls"] == calls  # nothing crossed a link
    sent += out
    given += g

    q.form([b, a], a.manager.step)  # b rejoins, healed to a's step, as rank 0
    for step in range(2):
        grads = grads_for(2, 40 + step)  # member order: b, a
        outs = q.sync(grads)
        assert q.commit()
        assert torch.equal(outs[0], outs[1])
        sent += 2 * outs[0]
        given += grads[0] + grads[1]
    st_a, st_b = a.ft.stats()["g"], b.ft.stats()["g"]
    assert (st_a["replicas"], st_a["rank"], st_b["rank"]) == (2, 1, 0)
    assert st_a["form"] == "two-phase"
    # what b owed before it left is what was dropped, no more (a's state all carried)
    # and no less (b's residual kept would make the two sides differ by it)
    assert stale_b.abs().max() > 1e-2
    torch.testing.assert_close(sent + owed(a) + owed(b) + stale_b, given, rtol=0, atol=1e-4)


def test_quorum_three_to_two_drops_the_leaver_and_carries_the_survivors() -> None:
    """R 3 -> 2, two-phase (L not a multiple of 2 or 3: both pad): the middle replica
    leaves; the survivors' reducers are rebuilt for R = 2 with ranks 0 and 1, their
    owner-side state folded into their residuals at the old chunks, and after two more
    syncs nothing owed is lost or counted twice but what the leaver owed."""
    cfg = TAGCConfig(mode="quant", residual_code="none", residual_factor=1.0,
                     hsdp_allreduce="two_phase")
    a, b, c = (Replica(cfg) for _ in range(3))
    q = Quorums()
    q.form([a, b, c], 0)
    sent, given = torch.zeros(L), torch.zeros(L)
    for step in range(2):
        grads = grads_for(3, 50 + step)
        outs = q.sync(grads)
        assert q.commit()
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
        sent += 3 * outs[0]
        given += sum(grads)
    assert a.ft.units["g"].chunk == -(-L // 3)
    left = owed(b)
    assert left.abs().sum() > 0
    q.form([a, c], a.manager.step)  # b fails
    for step in range(2):
        grads = grads_for(2, 60 + step)
        outs = q.sync(grads)
        assert q.commit()
        assert torch.equal(outs[0], outs[1])
        sent += 2 * outs[0]
        given += sum(grads)
    st_a, st_c = a.ft.stats()["g"], c.ft.stats()["g"]
    assert (st_a["replicas"], st_a["rank"], st_c["rank"]) == (2, 0, 1)
    assert a.ft.units["g"].chunk == -(-L // 2)
    torch.testing.assert_close(sent + owed(a) + owed(c) + left, given, rtol=0, atol=1e-4)


def test_failed_sync_leaves_every_state_bit_identical() -> None:
    """(c) a step that does not commit (the vote) and a sync that fails mid-exchange
    (one replica's send raises, its peer's receive times out): every replica's state
    is bit for bit what it was; the next quorum trains on."""
    # fp32 residuals: the encoder updates them in place before the send that fails
    # (coded ones are only coded back after a call that finished)
    cfg = TAGCConfig(mode="quant", residual_code="none", residual_factor=1.0)
    reps = [Replica(cfg, pg_timeout=3.0) for _ in range(2)]
    q = Quorums()
    q.form(reps, 0)
    for step in range(2):
        q.sync(grads_for(2, 50 + step))
        assert q.commit()
    before = [r.ft.feedback_state("g") for r in reps]
    assert before[0]["residual"] is not None

    def same_as_before() -> bool:
        return all(torch.equal(before[i][k], reps[i].ft.feedback_state("g")[k])
                   for i in range(2) for k in before[i])

    q.sync(grads_for(2, 60))
    assert not same_as_before()  # the sync did change the state...
    for r in reps:
        r.manager.error = RuntimeError("a peer failed to commit")
    assert q.commit() is False and all(r.manager.step == 2 for r in reps)
    assert same_as_before()  # ...and the failed vote put it back

    for r in reps:
        r.manager.error = None
    reps[0].pg.fail = True
    q.sync(grads_for(2, 61))
    reps[0].pg.fail = False
    assert all(r.manager.error is not None for r in reps)
    assert same_as_before()  # restored at once, before any vote
    assert q.commit() is False and same_as_before()

    q.form(reps, 2)  # a new quorum, a fresh group: training goes on
    outs = q.sync(grads_for(2, 62))
    assert q.commit() and reps[0].manager.step == 3
    assert torch.equal(outs[0], outs[1]) and not same_as_before()


def test_carry_decodes_and_codes_again_coded_residuals() -> None:
    """The carry of ``residual_code`` int4 state from (R 3, rank 1, two-phase) to
    (R 2, rank 0, all-gather): the residual's first L entries plus the owner's
    residual_out at its chunk, decoded, coded again; the old codes untouched."""
    cfg = TAGCConfig(mode="quant", residual_code="int4", hsdp_allreduce="auto")
    streams = CodecStreams()
    old = build_reducer(cfg, "g", None, 1, 3, L, torch.device("cpu"), streams)
    new = build_reducer(cfg, "g", None, 0, 2, L, torch.device("cpu"), streams)
    assert (old.FORM, new.FORM) == ("two-phase", "gather")
    gen = torch.Generator().manual_seed(7)
    res = torch.randn(old.flat_numel, generator=gen)
    res[L:] = 0  # padding never holds anything
    out = torch.randn(old.chunk, generator=gen)

    def code(x: torch.Tensor) -> torch.Tensor:
        c = torch.zeros(coded_bytes(x.numel(), "int4", cfg.quant_block), dtype=torch.uint8)
        _tagc.quant_encode(c, None, x, "int4", cfg.quant_block)
        return c

    def decode(c: torch.Tensor, n: int) -> torch.Tensor:
        x = torch.zeros(n)
        _tagc.quant_decode_add(x, c, "int4", cfg.quant_block)
        return x

    old.residual, old.residual_out = code(res), code(out)
    held = (old.residual.clone(), old.residual_out.clone())
    carry_feedback(old, new)
    assert torch.equal(old.residual, held[0]) and torch.equal(old.residual_out, held[1])
    assert new.residual.dtype == torch.uint8
    want = decode(held[0], old.flat_numel)[:L]
    want[old.chunk:2 * old.chunk] += decode(held[1], old.chunk)
    got = decode(new.residual, L)
    # one more int4 rounding: at most half a step (a block's largest value / 7)
    block = cfg.quant_block
    for lo in range(0, L, block):
        w, g = want[lo:lo + block], got[lo:lo + block]
        assert (g - w).abs().max() <= w.abs().max() / 14 * (1 + 1e-5)


def _manager_replica(lighthouse: str, rid: int, cfg: TAGCConfig, steps: int,
                     gate: Callable[[int], None], stop_after: Optional[int] = None
                     ) -> List[Dict[str, Any]]:
    """One replica with torchft's Manager (synchronous quorum) and FTAllReduce: per
    step its R, gradient, output and residual after the commit."""
    from torchft.manager import Manager

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
    state = {"w": torch.zeros(4)}  # what a rejoining replica heals from a peer
    wait = timedelta(seconds=20)
    m = Manager(pg=pg, min_replica_size=1, load_state_dict=state.update,
                state_dict=lambda: dict(state), replica_id=str(rid), store_addr="localhost",
                store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                use_async_quorum=False, timeout=wait, quorum_timeout=wait,
                connect_timeout=wait)
    ft = FTAllReduce(m, pg, cfg)
    log: List[Dict[str, Any]] = []
    try:
        while m.current_step() < steps:
            gate(m.current_step())
            m.start_quorum()
            step = m.current_step()
            g = torch.randn(L, generator=torch.Generator().manual_seed(100 * step + rid))
            out = g.clone()
            ft.allreduce(out).wait()
            ok = ft.should_commit()
            log.append({"step": step, "R": m.num_participants(), "ok": ok, "g": g,
                        "out": out, "res": ft.feedback_state(0)["residual"]})
            if stop_after is not None and m.current_step() >= stop_after:
                break
    finally:
        m.shutdown(wait=True)
    return log


def test_with_torchft_manager_a_replica_leaves_and_rejoins() -> None:
    """torchft's Lighthouse and Managers: A and B train 2 steps, B leaves, A trains 2
    alone (the tensor its own mean, its residual untouched), B comes back as a fresh
    process would, heals from A and joins with a zero residual; every output of a
    2-replica step is bit-equal on both and nothing owed is lost."""
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100,
                          heartbeat_timeout_ms=400)
    cfg = TAGCConfig(mode="quant", residual_code="none", residual_factor=1.0)
    start = threading.Barrier(2, timeout=20)
    left, alone, back = threading.Event(), threading.Event(), threading.Event()

    def a_gate(step: int) -> None:
        if step == 0:
            start.wait()
        if step == 2:  # past B's last heartbeat: the quorum is A alone
            left.wait(20)
            time.sleep(0.8)
        if step == 4:  # B's Manager up before A asks: the quorum is both again
            alone.set()
            back.wait(20)
            time.sleep(0.2)

    def b_first() -> List[Dict[str, Any]]:
        try:
            return _manager_replica(lh.address(), 1, cfg, 6,
                                    lambda s: start.wait() if s == 0 else None, stop_after=2)
        finally:
            left.set()

    try:
        with ThreadPoolExecutor(3) as pool:
            fa = pool.submit(_manager_replica, lh.address(), 0, cfg, 6, a_gate)
            b1 = pool.submit(b_first).result()
            assert alone.wait(30)
            b2 = pool.submit(_manager_replica, lh.address(), 1, cfg, 6,
                             lambda s: back.set()).result()
            a = fa.result()
    finally:
        lh.shutdown()
    assert [(e["step"], e["R"], e["ok"]) for e in a] == \
        [(0, 2, True), (1, 2, True), (2, 1, True), (3, 1, True), (4, 2, True), (5, 2, True)]
    assert [e["step"] for e in b1] == [0, 1] and [e["step"] for e in b2] == [4, 5]
    for x, y in zip(a[:2] + a[4:], b1 + b2):
        assert torch.equal(x["out"], y["out"])
    for e in a[2:4]:
        assert torch.equal(e["out"], e["g"]) and torch.equal(e["res"], a[1]["res"])
    # the rejoined B starts at zero: A's residual before the rejoin is all that was owed
    sent = sum(2 * e["out"] for e in a[4:])
    given = sum(x["g"] + y["g"] for x, y in zip(a[4:], b2))
    torch.testing.assert_close(sent + a[-1]["res"] + b2[-1]["res"], given + a[3]["res"],
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode,replicas,form", [
    ("quant", 3, "two-phase"), ("sparse", 3, "two-phase"), ("exact", 3, "two-phase"),
    ("paper", 3, "two-phase"), ("sparse", 2, "gather")])
def test_every_form_over_torchft_groups(mode: str, replicas: int, form: str) -> None:
    """Each transport over torchft's groups (ring steps, list all-gather, the reduce
    as an all-reduce): bit-equal on every replica, and the outputs times R plus what
    each replica owes equal every input summed."""
    cfg = TAGCConfig(mode=mode, residual_code="none", residual_factor=1.0) if mode == "quant" else \
        TAGCConfig(mode=mode)
    reps = [Replica(cfg) for _ in range(replicas)]
    q = Quorums()
    q.form(reps, 0)
    sent, given = torch.zeros(L), torch.zeros(L)
    for step in range(2):
        grads = grads_for(replicas, 70 + step)
        outs = q.sync(grads)
        assert q.commit()
        assert all(torch.equal(o, outs[0]) for o in outs)
        sent += replicas * outs[0]
        given += sum(grads)
    torch.testing.assert_close(sent + sum(owed(r) for r in reps), given, rtol=0, atol=2e-4)
    st = reps[0].ft.stats()["g"]
    assert st["form"] == form and st["compressed_calls"] == 2


def _diloco_replica(lighthouse: str, rid: int, cfg: TAGCConfig, syncs: int,
                    start: threading.Barrier) -> Dict[str, Any]:
    """One replica of torchft's DiLoCo over two equal-shaped fragments, its manager
    an FTManager: per sync the synced fragment's parameters, and the reducers."""
    from torch import nn
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
    torch.manual_seed(0)  # the same model on both replicas (init_sync is on anyway)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    frags = [model[0], model[2]]
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for f in frags]
    wait = timedelta(seconds=20)
    m = Manager(pg=pg, min_replica_size=2, load_state_dict=model.load_state_dict,
                state_dict=model.state_dict, replica_id=str(rid), store_addr="localhost",
                store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                use_async_quorum=False, timeout=wait, quorum_timeout=wait,
                connect_timeout=wait)
    fm = FTManager(m, pg, cfg, fragments=2)
    start.wait()
    synced: List[List[torch.Tensor]] = []
    gen = torch.Generator().manual_seed(rid)
    try:
        with DiLoCo(fm, frags, inner, outer, sync_every=4):
            while m.current_step() < syncs:
                done = m.current_step()
                loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
                inner.zero_grad()
                loss.backward()
                inner.step()  # DiLoCo's hook syncs a fragment every 2 steps here
                if m.current_step() > done:
                    frag = frags[done % 2]
                    synced.append([p.detach().clone() for p in frag.parameters()])
    finally:
        m.shutdown(wait=True)
    return {"synced": synced, "units": dict(fm.ft.units), "stats": fm.ft.stats()}


def test_diloco_with_ft_manager_keys_fragments_apart() -> None:
    """torchft's DiLoCo (two fragments of equal shapes) with FTManager as its manager:
    after every sync the synced fragment is bit-equal on both replicas; each fragment's
    tensors have their own reducers, compressed at each of their syncs."""
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100)
    cfg = TAGCConfig(mode="quant")
    start = threading.Barrier(2, timeout=20)
    try:
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(lambda r: _diloco_replica(lh.address(), r, cfg, 4, start), [0, 1])
    finally:
        lh.shutdown()
    assert len(a["synced"]) == len(b["synced"]) == 4
    for pa, pb in zip(a["synced"], b["synced"]):
        assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    # (fragment, position): weight then bias of each Linear, 2 syncs each
    assert set(a["units"]) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert a["units"][(0, 0)] is not a["units"][(1, 0)]
    assert [a["units"][(f, 0)].shard_numel for f in (0, 1)] == [256, 256]
    assert not torch.equal(a["units"][(0, 0)].residual, a["units"][(1, 0)].residual)
    assert all(st["compressed_calls"] == 2 for st in a["stats"].values())


def test_feedback_state_of_a_checkpoint_resumes_bit_for_bit() -> None:
    """``FTAllReduce.state_dict()`` loaded into fresh replicas (a resumed run): the
    next syncs give the outputs and states of the replicas that never stopped, bit
    for bit, in the same quorum and with the ranks swapped (the state carried as after
    a quorum change); a state taken inside a step (exchanged, not voted) is the one
    before the step."""
    cfg = TAGCConfig(mode="quant", hsdp_allreduce="two_phase")
    a, b = Replica(cfg), Replica(cfg)
    q = Quorums()
    q.form([a, b], 0)
    for step in range(2):
        q.sync(grads_for(2, 80 + step))
        assert q.commit()
    saved = [r.ft.state_dict() for r in (a, b)]
    want = q.sync(grads_for(2, 90))  # inside step 2: the saved state is still the commit's
    mid = [r.ft.state_dict() for r in (a, b)]
    assert q.commit()
    after = [r.ft.feedback_state("g") for r in (a, b)]
    for x, y in zip(saved, mid):
        assert x["step"] == y["step"] == 2
        assert all(torch.equal(x["units"]["g"]["buffers"][n], t)
                   for n, t in y["units"]["g"]["buffers"].items() if t is not None)

    for order in ((0, 1), (1, 0)):
        fresh = [Replica(cfg), Replica(cfg)]
        for r, sd in zip(fresh, saved):
            r.ft.load_state_dict(sd)
        grads = grads_for(2, 90)
        q2 = Quorums()
        q2.form([fresh[i] for i in order], 2)
        outs = q2.sync([grads[i] for i in order])
        assert q2.commit()
        assert torch.equal(outs[0], outs[1])
        if order == (0, 1):  # the same quorum: what a and b did at step 2
            assert torch.equal(outs[0], want[0])
            for st, f in zip(after, fresh):
                sf = f.ft.feedback_state("g")
                assert all(torch.equal(st[n], sf[n]) for n in st if st[n] is not None)
        else:
            assert fresh[1].ft.stats()["g"]["rank"] == 0
