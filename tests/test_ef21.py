"""What EF21 hands to FSDP, bit for bit, against an independent recursion.

The other EF21 tests check the bookkeeping (each owner's estimate is the sum of the
ranks' ``h``); these check the *output*: a :class:`tagc.reducer.UnitReducer` on 2
gloo ranks reduces synthetic gradients for several steps, and every rank compares
the shard it was handed (and its state) with a recursion written here from the
algorithm's definition, on this file's own numpy block quantizer
(``tests/test_quant.py``'s reference), for every rank at once:

* damping (``ef21_damping``, docs/DESIGN.md section 5):
  ``lam = clip(sum_i <g_i, h_i> / sum_i ||h_i||^2, 0, 1)``, ``h_i <- lam h_i``,
  ``est_j <- lam est_j``;
* each rank codes the other owner's shard of ``v = g - h`` and keeps ``v - C(v)``;
  its own shard goes exact;
* ``h_i <- g_i - (v_i - C(v_i))``; the owner's ``est += sum of what arrived``;
  the output is ``est / (pre * post)``.

A regression that handed FSDP the sum of this call's messages instead of the
estimate, skipped the damping on one side, or damped with another factor fails
here.  Under ``bypass_every`` a call may take the plain path that settles the
state (``est`` = the exact sum, ``h = g``); the path each call took is read from
the unit's counters and the reference follows it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import tagc_hook as tagc
from dist_helpers import SharedSpawn, run_cases
from tagc.device import CodecStreams
from tagc.reducer import UnitReducer
from tagc.selection import UnitSpec
from test_quant import encode_ref, owner_format_ref

pytest.importorskip("_tagc")

N = 2
S = 777  # an odd shard: the last quant block of each shard is partial
STEPS = 7


def grads(step: int) -> List[torch.Tensor]:
    """Every rank's flat gradient (N shards of S) at ``step``: a drifting shared
    direction plus per-rank noise whose weight grows with the step, so the
    gradients go from persistent (damping near 1) to mostly noise."""
    gen = torch.Generator().manual_seed(1000 + step)
    shared = torch.randn(N * S, generator=gen)
    base = torch.randn(N * S, generator=torch.Generator().manual_seed(7))
    out = []
    for i in range(N):
        noise = torch.randn(N * S, generator=torch.Generator().manual_seed(50 * step + i))
        w = 0.15 * step
        g = base + 0.2 * shared + w * noise
        g[: 5 + step] *= 40.0  # a few outliers in the first block of shard 0
        out.append(g.float())
    return out


def _quantize(v: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """C(v) by the reference quantizer, block by block over one shard."""
    return torch.from_numpy(encode_ref(v.numpy(), fmt, block)[1])


class Reference:
    """The EF21 recursion of every rank and owner, in plain torch."""

    def __init__(self, cfg: tagc.TAGCConfig, divisor: float) -> None:
        self.cfg, self.divisor = cfg, divisor
        self.h = [torch.zeros(N * S) for _ in range(N)]
        self.est = [torch.zeros(S) for _ in range(N)]
        self.started = False

    def damping(self, g: List[torch.Tensor]) -> float:
        """The pooled least-squares factor; 1 before any state exists."""
        if not (self.cfg.ef21_damping and self.started):
            return 1.0
        gh = sum(float(torch.dot(g[i], -(-self.h[i]))) for i in range(N))
        hh = sum(float(torch.dot(self.h[i], self.h[i])) for i in range(N))
        lam = gh / hh if hh > 0 else 1.0
        return min(max(lam, 0.0), 1.0)

    def compressed(self, g: List[torch.Tensor]) -> List[torch.Tensor]:
        """One compressed call; returns every owner's output shard."""
        lam = self.damping(g)
        if self.started:
            # stored negated in the product, and -(lam * x) == lam * -x exactly
            self.h = [h * lam for h in self.h]
            self.est = [e * lam for e in self.est]
        fmt, block = self.cfg.quant_format, self.cfg.quant_block
        v = [g[i] - self.h[i] for i in range(N)]
        kept = [x.clone() for x in v]  # v - C(v); 0 on the own shard
        deq = {}
        for i in range(N):
            for j in range(N):
                sl = slice(j * S, (j + 1) * S)
                if i == j:
                    kept[i][sl] = 0.0
                else:
                    deq[i, j] = _quantize(v[i][sl], fmt, block)
                    kept[i][sl] = v[i][sl] - deq[i, j]
        outs = []
        for j in range(N):
            sl = slice(j * S, (j + 1) * S)
            acc = torch.zeros(S)
            for i in range(N):  # the owner adds in rank order, its own shard as g + (-h)
                if i == j:
                    acc = acc + g[j][sl]
                    acc = acc + (-self.h[j][sl])
                else:
                    acc = acc + deq[i, j]
            self.est[j] = self.est[j] + acc
            outs.append(self.est[j] / self.divisor)
        self.h = [g[i] - kept[i] for i in range(N)]
        self.started = True
        return outs

    def settled(self, g: List[torch.Tensor]) -> List[torch.Tensor]:
        """A plain call that settles the state: the exact sums, h = g."""
        total = g[0] + g[1]
        self.est = [total[j * S:(j + 1) * S].clone() for j in range(N)]
        self.h = [x.clone() for x in g]
        self.started = True
        return [e / self.divisor for e in self.est]


def _settles(u: UnitReducer, call: Any) -> bool:
    """Run one reduction; whether it took a plain path that settles the state (the
    bypass or the guard), read from the unit's counters."""
    before = u.stats.as_dict()
    call()
    after = u.stats.as_dict()
    return any(after[k] > before[k] for k in ("bypassed_calls", "guard_resets"))


def _run(rank: int, n: int, fields: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(0)
    cfg = tagc.TAGCConfig(mode="quant", ef21=True, **fields)
    u = UnitReducer(cfg, UnitSpec("unit", 0, N * S, N * S, N * S, torch.device("cpu")),
                    dist.group.WORLD, rank, n, 1.0, float(n), CodecStreams())
    ref = Reference(cfg, u.pre * u.post)
    damps, paths = [], []
    for step in range(STEPS):
        g = grads(step)
        out = torch.full((S,), float("nan"))
        settled = _settles(u, lambda: u.reduce(g[rank].clone(), out))
        paths.append("plain" if settled else "compressed")
        want = (ref.settled if settled else ref.compressed)(g)[rank]
        assert torch.equal(out, want), (step, paths[-1], float((out - want).abs().max()))
        assert torch.equal(-u.residual, ref.h[rank]), step
        assert torch.equal(u.estimate, ref.est[rank]), step
        if not settled:
            damps.append(u.damp)
    return {"damps": damps, "paths": paths}


@pytest.mark.parametrize("fmt", ["int4", "ternary"])
@pytest.mark.parametrize("damping", [True, False])
def test_output_matches_independent_recursion(fmt: str, damping: bool) -> None:
    res = SPAWN.case(N, f"recursion/{fmt}/{damping}")
    assert res[0] == res[1]  # the same factors and paths on both ranks
    damps = res[0]["damps"]
    if damping:
        assert damps[0] == 1.0  # no state before the first call: nothing to scale
        # the gradients turn to noise: the factor leaves 1 and falls
        assert all(0.0 <= d <= 1.0 for d in damps[1:]), damps
        assert damps[1] > 0.5 and min(damps[2:]) < 0.5 * damps[1], damps
    else:
        assert all(d is None for d in damps), damps


def test_output_matches_under_bypass() -> None:
    """bypass_every=2: the calls that went plain settle the state; the others follow
    the damped recursion from there."""
    res = SPAWN.case(N, "recursion/bypass")
    assert res[0]["paths"] == res[1]["paths"]
    assert "plain" in res[0]["paths"] and "compressed" in res[0]["paths"], res[0]["paths"]


class TwoPhaseReference(Reference):
    """HSDP's two-phase all-reduce with EF21 (tagc/hsdp.py ``TwoPhaseReducer``): the
    to-the-owner phase is :class:`Reference`'s recursion (no divide: FSDP divides
    after the hook); every replica holds ``w``, every owner's estimate as sent so
    far; owner j codes ``est_j - lam w_j`` (on ``hsdp_out_format``; auto: int4 after
    ternary/sign, else the uplink's code) and everyone adds the decoded change (EF21
    on the way out); the hook's output is ``w``, the same on every replica."""

    def __init__(self, cfg: tagc.TAGCConfig) -> None:
        super().__init__(cfg, 1.0)
        self.w = torch.zeros(N, S)

    def compressed(self, g: List[torch.Tensor]) -> List[torch.Tensor]:
        lam, started = self.damping(g), self.started
        est = super().compressed(g)
        if started and self.cfg.ef21_damping:
            self.w = self.w * lam
        fmt = owner_format_ref(self.cfg.quant_format, self.cfg.hsdp_out_format)
        block = self.cfg.quant_block
        for j in range(N):
            self.w[j] = self.w[j] + _quantize(est[j] - self.w[j], fmt, block)
        return [self.w.reshape(-1).clone() for _ in range(N)]

    def settled(self, g: List[torch.Tensor]) -> List[torch.Tensor]:
        est = super().settled(g)
        self.w = torch.stack(est)
        return [self.w.reshape(-1).clone() for _ in range(N)]


def _run_two_phase(rank: int, n: int, fields: Dict[str, Any]) -> List[str]:
    from tagc.hsdp import TwoPhaseReducer

    cfg = tagc.TAGCConfig(mode="quant", ef21=True, **fields)
    u = TwoPhaseReducer(cfg, UnitSpec("unit", 0, N * S, N * S, N * S, torch.device("cpu")),
                        dist.group.WORLD, rank, n, CodecStreams(), N * S)
    ref = TwoPhaseReference(cfg)
    paths = []
    for step in range(STEPS):
        g = grads(step)
        t = g[rank].clone()
        settled = _settles(u, lambda: u.hook(t))
        paths.append("plain" if settled else "compressed")
        want = (ref.settled if settled else ref.compressed)(g)[rank]
        assert torch.equal(t, want), (step, paths[-1], float((t - want).abs().max()))
        assert torch.equal(-u.residual, ref.h[rank]), step
        assert torch.equal(u.estimate, ref.est[rank]), step
        assert torch.equal(u.estimate_out, ref.w.reshape(-1)), step
    return paths


TWO_PHASE = {"int4": {"quant_format": "int4"},
             "ternary-undamped": {"quant_format": "ternary", "ef21_damping": False},
             "ternary-owners": {"quant_format": "ternary", "hsdp_out_format": "ternary"},
             "bypass": {"quant_format": "int4", "bypass_every": 2}}


@pytest.mark.parametrize("which", list(TWO_PHASE))
def test_two_phase_hsdp_output_matches_independent_recursion(which: str) -> None:
    """The two-phase HSDP all-reduce (2 replicas) hands FSDP the EF21-P output ``w``
    of the recursion above, bit for bit, with every state; under the bypass the
    settled calls make every estimate exact."""
    paths = SPAWN.case(N, f"two_phase/{which}")
    assert paths[0] == paths[1]
    if "bypass_every" in TWO_PHASE[which]:
        assert "plain" in paths[0] and "compressed" in paths[0], paths[0]


def test_damping_needs_ef21() -> None:
    with pytest.raises(ValueError, match="ef21_damping"):
        tagc.TAGCConfig(mode="quant", ef21=False, ef21_damping=True)
    assert tagc.TAGCConfig(mode="quant", ef21=True).ef21_damping is True
    assert tagc.TAGCConfig(mode="quant", ef21=False).ef21_damping is False
    with pytest.raises(ValueError, match="ef21_damping"):
        tagc.TAGCConfig(mode="quant", ef21=True, ef21_damping="yes")


def _device_vote(rank: int, n: int) -> Dict[str, Any]:
    """The CUDA form of the vote (sums kept on the device, no host sync), run on CPU
    tensors: the same factor as the host form, and 1 with ``ok`` false when a rank's
    gradient is not finite (so the damping leaves the state as it was)."""
    from tagc.comm import Comm
    from tagc.device import Exec

    cfg = tagc.TAGCConfig(mode="quant", quant_format="int4", ef21=True, guard_ratio=0)
    u = UnitReducer(cfg, UnitSpec("unit", 0, N * S, N * S, N * S, torch.device("cpu")),
                    dist.group.WORLD, rank, n, 1.0, float(n), CodecStreams())
    for step in range(2):  # a state to damp
        u.reduce(grads(step)[rank].clone(), torch.empty(S))
    g = grads(5)[rank].clone()
    host = u._agree(Comm(u.group, rank, n, u.stats, Exec(g)), g)
    lam = u.damp
    dev = Exec(g)
    device = u._agree_device(Comm(u.group, rank, n, u.stats, dev), g)
    assert host == device == "compress" and isinstance(u.damp, torch.Tensor)
    assert float(u.damp) == lam and 0.0 < lam < 1.0, (float(u.damp), lam)
    assert bool(dev.ok)
    bad = g.clone()
    if rank == 1:
        bad[3] = float("nan")
    dev = Exec(bad)
    u._agree_device(Comm(u.group, rank, n, u.stats, dev), bad)
    assert not bool(dev.ok) and float(u.damp) == 1.0
    return {"lam": lam}


def _suite(rank: int, n: int) -> Dict[str, Tuple[str, Any]]:
    cases: List[Tuple[str, Callable[..., Any]]] = [
        (f"recursion/{fmt}/{damping}",
         lambda r, w, f=fmt, d=damping: _run(r, w, {"quant_format": f, "ef21_damping": d}))
        for fmt in ("int4", "ternary") for damping in (True, False)]
    cases.append(("recursion/bypass",
                  lambda r, w: _run(r, w, {"quant_format": "int4", "bypass_every": 2})))
    cases += [(f"two_phase/{k}", lambda r, w, f=f: _run_two_phase(r, w, f))
              for k, f in TWO_PHASE.items()]
    cases.append(("device_vote", _device_vote))
    return run_cases(rank, n, cases)


SPAWN = SharedSpawn(_suite, timeout=300)  # every case above in one 2-rank spawn


def test_device_vote_agrees_with_host_vote() -> None:
    res = SPAWN.case(N, "device_vote")
    assert res[0] == res[1]
