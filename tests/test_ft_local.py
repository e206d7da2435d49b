"""TAGC's local steps over a torchft quorum (tagc/ft.py, docs/TORCHFT.md).

Replicas are threads of this process with torchft's gloo groups (tests/ft_helpers.py);
each trains a small two-unit model whose inner steps fire :class:`FTLocalSteps` from
the optimizer's hook, which takes the quorum, exchanges and votes from the replica's
own thread.  The tests form the quorums (and stage heals) between steps.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

pytest.importorskip("torchft", reason="torchft not installed (pip install tagc[ft])")
from ft_helpers import Quorums, Replica  # noqa: E402

from tagc.config import TAGCConfig  # noqa: E402
from tagc.ft import FTLocalSteps  # noqa: E402

pytestmark = pytest.mark.codec


class LocalReplica(Replica):
    """A replica with a model (two units), an inner optimizer and FTLocalSteps."""

    def __init__(self, cfg: TAGCConfig, rid: int, pg_timeout: float = 20.0) -> None:
        super().__init__(cfg, pg_timeout)
        torch.manual_seed(0)  # the same weights on every replica
        self.model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 7))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.5)
        self.manager.register_state_dict_fn(
            "model", lambda sd: (self.model.load_state_dict(sd["m"]),
                                 self.opt.load_state_dict(sd["o"])),
            lambda: {"m": {k: v.clone() for k, v in self.model.state_dict().items()},
                     "o": self.opt.state_dict()})
        self.outer = FTLocalSteps([self.model[0], self.model[2]], cfg, self.manager,
                                  self.pg, self.opt)
        self.ft = self.outer.ft
        self.rid = rid

    def inner_step(self, k: int) -> None:
        """One inner step on this replica's batch k (the sync, when due, inside)."""
        g = torch.Generator().manual_seed(1000 * self.rid + k)
        loss = self.model(torch.randn(16, 12, generator=g)).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def outer_state(self) -> List[Dict[str, torch.Tensor]]:
        return [{"start": u.outer_start.clone(), "momentum": u.outer_momentum.clone(),
                 "inner": u.outer_inner.clone()} for u in self.outer.units]

    def shards(self) -> List[torch.Tensor]:
        return [self.outer._shard(i) for i in range(len(self.outer.units))]

    def feedback(self) -> Dict[Any, Dict[str, Any]]:
        return {k: self.ft.feedback_state(k) for k in self.ft.units}


def cfg_for(**kw: Any) -> TAGCConfig:
    return TAGCConfig(mode="quant", outer_every=2, outer_lr=0.7, outer_momentum=0.9, **kw)


def vote_together(q: Quorums) -> None:
    """The members of the quorum just formed vote from their own threads."""
    ballot = threading.Barrier(len(q.members), timeout=30)
    for r in q.members:
        r.manager.ballot, r.manager.voters = ballot, [m.manager for m in q.members]


def steps(q: Quorums, ks: List[int]) -> None:
    """Member i takes its inner step ks[i], all at once."""
    with ThreadPoolExecutor(len(q.members)) as pool:
        list(pool.map(lambda i: q.members[i].inner_step(ks[i]), range(len(q.members))))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_syncs_agree_and_a_failed_one_changes_nothing() -> None:
    """Two replicas, H = 2: every committed sync leaves both with the same anchor,
    momentum and shards; a sync whose exchange fails (one replica's send raises, its
    peer's receive times out) is not committed on either, and afterwards every outer
    and feedback state is bit for bit what it was before that sync, the shards as the
    local steps left them (none written); the next quorum syncs and both agree again."""
    cfg = cfg_for(residual_code="none")
    a, b = LocalReplica(cfg, 0, pg_timeout=3.0), LocalReplica(cfg, 1, pg_timeout=3.0)
    q = Quorums()
    k = 0
    for _ in range(2):
        q.form([a, b], a.manager.step)
        vote_together(q)
        for _ in range(2):
            steps(q, [k, k])
            k += 1
        assert same(a.outer_state(), b.outer_state()) and same(a.shards(), b.shards())
    assert a.outer.commits == b.outer.commits == 2 and a.manager.step == 2
    assert a.ft.wire_bytes > 0 and a.feedback()[0]["residual"] is not None

    q.form([a, b], 2)
    vote_together(q)
    steps(q, [k, k])
    k += 1
    before = [(r.outer_state(), r.feedback()) for r in (a, b)]
    writes: List[int] = []
    for r in (a, b):  # the only way the outer loop changes a shard
        r.outer._write = lambda i, flat, w=r.outer._write: (writes.append(i), w(i, flat))
    a.pg.fail = True
    steps(q, [k, k])  # the sync: a's send raises, b's receive times out
    k += 1
    a.pg.fail = False
    for r in (a, b):
        del r.outer._write
    assert a.outer.failures == b.outer.failures == 1 and a.manager.step == 2
    for r, (outer, fb) in zip((a, b), before):
        assert same(r.outer_state()[0]["start"], outer[0]["start"])
        assert same([{x: s[x] for x in ("start", "momentum")} for s in r.outer_state()],
                    [{x: s[x] for x in ("start", "momentum")} for s in outer])
        assert same(r.feedback(), fb)
        # the local steps kept: the fragment's next sync sends them
        assert writes == [] and not same(r.shards(), [s["start"] for s in outer])

    q.form([a, b], 2)  # a fresh group: training goes on
    vote_together(q)
    for _ in range(2):
        steps(q, [k, k])
        k += 1
    assert a.outer.commits == 3 and a.manager.step == 3
    assert same(a.outer_state(), b.outer_state()) and same(a.shards(), b.shards())
    assert not same(a.feedback(), before[0][1])


def test_two_one_two_a_lone_replica_steps_alone_and_a_joiner_heals_to_its_fragment() -> None:
    """Two fragments (H = 2: fragment 0 at even inner steps, 1 at odd ones).  A and B
    sync together; B leaves; A syncs alone (R = 1: nothing sent, its own
    pseudo-gradient is the mean, the outer step taken by Nesterov's rule, its feedback
    untouched); a fresh B starts (step 0, due to sync fragment 0) and heals from A at
    its first quorum, where A syncs fragment 1: the healed B takes A's counters,
    anchor and momentum, syncs fragment 1 with a zero residual, and both end equal."""
    cfg = cfg_for(outer_fragments=2)
    a, b = LocalReplica(cfg, 0), LocalReplica(cfg, 1)
    assert a.outer.offsets == [0, 1]
    q = Quorums()
    q.form([a, b], 0)
    vote_together(q)
    for k in range(3):  # fragment 0 at inner step 2, fragment 1 at 3
        steps(q, [k, k])
    assert a.manager.step == 2 and same(a.outer_state(), b.outer_state())

    q.form([a], 2)  # B fails
    vote_together(q)
    before_fb, sent = a.feedback(), a.ft.wire_bytes
    start, mom = [s.clone() for s in (a.outer.units[0].outer_start,
                                      a.outer.units[0].outer_momentum)]
    a.inner_step(3)  # inner step 4: fragment 0, alone
    assert a.manager.step == 3 and a.ft.wire_bytes == sent
    assert same(a.feedback(), before_fb)
    # Nesterov on the lone replica's own pseudo-gradient d (m' = mu m + d,
    # start' = start - lr (d + mu m')), d read back from the momentum
    mu, lr = cfg.outer_momentum, cfg.outer_lr
    u = a.outer.units[0]
    d = u.outer_momentum - mom.mul(mu)
    assert d.abs().max() > 1e-4
    torch.testing.assert_close(u.outer_start, start - lr * (d + mu * u.outer_momentum),
                               rtol=0, atol=1e-6)
    assert torch.equal(a.outer._shard(0), u.outer_start)
    a.inner_step(4)  # inner step 5: fragment 1, alone
    assert a.manager.step == 4 and a.outer.step == 5

    a.inner_step(5)  # inner step 6: fragment 0, alone
    b2 = LocalReplica(cfg, 1)  # restarted: its own step 0, its schedule fragment 0 first
    q.form([b2, a], a.manager.step)
    b2.manager.heal(a.manager)
    vote_together(q)
    b2.inner_step(0)  # its inner step 1: no sync
    # A's inner step 7 syncs fragment 1; b2's step 2 would sync fragment 0
    steps(q, [1, 6])
    assert b2.outer.step == a.outer.step == 7
    assert a.manager.step == b2.manager.step == 6
    assert same(a.outer_state(), b2.outer_state()) and same(a.shards(), b2.shards())
    st = b2.ft.stats()
    assert set(st) == {1} and st[1]["calls"] == 1 and st[1]["replicas"] == 2


def test_three_to_two_the_survivors_sync_over_the_new_quorum() -> None:
    """R 3 -> 2: after a sync of three, the middle replica leaves; the survivors' next
    syncs run over R = 2 (their reducers rebuilt, ranks 0 and 1) and agree."""
    cfg = cfg_for(hsdp_allreduce="two_phase")
    a, b, c = (LocalReplica(cfg, i) for i in range(3))
    q = Quorums()
    q.form([a, b, c], 0)
    vote_together(q)
    steps(q, [0, 0, 0])
    steps(q, [1, 1, 1])
    assert same(a.outer_state(), c.outer_state()) and a.ft.stats()[0]["replicas"] == 3
    q.form([a, c], 1)
    vote_together(q)
    for k in (2, 3, 4, 5):
        steps(q, [k, k])
    assert a.manager.step == c.manager.step == 3
    assert same(a.outer_state(), c.outer_state()) and same(a.shards(), c.shards())
    st_a, st_c = a.ft.stats()[0], c.ft.stats()[0]
    assert (st_a["replicas"], st_a["rank"], st_c["rank"]) == (2, 0, 1)


def test_bad_units_are_refused() -> None:
    """No local steps in the config, no units, a unit without trained parameters, and
    units that share parameters (the whole model beside one of its layers)."""
    from ft_helpers import StubManager

    cfg = cfg_for()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = StubManager(None)
    with pytest.raises(ValueError, match="outer_every 0"):
        FTLocalSteps([model], TAGCConfig(mode="quant"), m, None, opt)
    with pytest.raises(ValueError, match="no units"):
        FTLocalSteps([], cfg, m, None, opt)
    with pytest.raises(ValueError, match="no trained parameters"):
        FTLocalSteps([model[1]], cfg, m, None, opt)
    with pytest.raises(ValueError, match="shares parameters"):
        FTLocalSteps([model[0], model], cfg, m, None, opt)
