"""What EF21 hands to FSDP, bit for bit, against an independent recursion.

The other EF21 tests check the bookkeeping (each owner's estimate is the sum of the
ranks' ``h``) or, beyond two ranks, sums to 1e-5; these check the *output*: a
:class:`tagc.reducer.UnitReducer` on 2 gloo ranks (and on 3, where every message goes
in ring steps, ``tagc.comm.Comm.stepped``) reduces synthetic gradients for several
steps, and every rank compares the shard it was handed (and its state) with a
recursion written here from the algorithm's definition, on this file's own numpy
block quantizer (``tests/test_quant.py``'s reference), for every rank at once:

* damping (``ef21_damping``, docs/DESIGN.md section 5):
  ``lam = clip(sum_i <g_i, h_i> / sum_i ||h_i||^2, 0, 1)``, ``h_i <- lam h_i``,
  ``est_j <- lam est_j``;
* each rank codes every other owner's shard of ``v = g - h`` and keeps ``v - C(v)``;
  its own shard goes exact;
* ``h_i <- g_i - (v_i - C(v_i))``; the owner's ``est += sum of what arrived``, added
  in rank order whatever order the messages travelled in;
  the output is ``est / (pre * post)``.

The same for HSDP's two-phase all-reduce (:class:`TwoPhaseReference`), at R = 2 and
at R = 3 (ring steps, a shard padded to R chunks).

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
PAD = 5  # R = 3 two-phase: the hook's shard is R chunks of S less PAD (padded back)


def grads(step: int, n: int = N) -> List[torch.Tensor]:
    """Every rank's flat gradient (n shards of S) at ``step``: a drifting shared
    direction plus per-rank noise whose weight grows with the step, so the
    gradients go from persistent (damping near 1) to mostly noise."""
    gen = torch.Generator().manual_seed(1000 + step)
    shared = torch.randn(n * S, generator=gen)
    base = torch.randn(n * S, generator=torch.Generator().manual_seed(7))
    out = []
    for i in range(n):
        noise = torch.randn(n * S, generator=torch.Generator().manual_seed(50 * step + i))
        w = 0.15 * step
        g = base + 0.2 * shared + w * noise
        g[: 5 + step] *= 40.0  # a few outliers in the first block of shard 0
        out.append(g.float())
    return out


def _quantize(v: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """C(v) by the reference quantizer, block by block over one shard."""
    return torch.from_numpy(encode_ref(v.numpy(), fmt, block)[1])


class Reference:
    """The EF21 recursion of every rank and owner (``n`` of them), in plain torch."""

    def __init__(self, cfg: tagc.TAGCConfig, divisor: float, n: int = N) -> None:
        self.cfg, self.divisor, self.n = cfg, divisor, n
        self.h = [torch.zeros(n * S) for _ in range(n)]
        self.est = [torch.zeros(S) for _ in range(n)]
        self.started = False

    def damping(self, g: List[torch.Tensor]) -> float:
        """The pooled least-squares factor; 1 before any state exists."""
        if not (self.cfg.ef21_damping and self.started):
            return 1.0
        gh = sum(float(torch.dot(g[i], -(-self.h[i]))) for i in range(self.n))
        hh = sum(float(torch.dot(self.h[i], self.h[i])) for i in range(self.n))
        lam = gh / hh if hh > 0 else 1.0
        return min(max(lam, 0.0), 1.0)

    def compressed(self, g: List[torch.Tensor]) -> List[torch.Tensor]:
        """One compressed call; returns every owner's output shard."""
        lam = self.damping(g)
        if self.started:
            # stored negated in the product, and -(lam * x) == lam * -x exactly
            self.h = [h * lam for h in self.h]
            self.est = [e * lam for e in self.est]
        fmt, block, n = self.cfg.quant_format, self.cfg.quant_block, self.n
        v = [g[i] - self.h[i] for i in range(n)]
        kept = [x.clone() for x in v]  # v - C(v); 0 on the own shard
        deq = {}
        for i in range(n):
            for j in range(n):
                sl = slice(j * S, (j + 1) * S)
                if i == j:
                    kept[i][sl] = 0.0
                else:
                    deq[i, j] = _quantize(v[i][sl], fmt, block)
                    kept[i][sl] = v[i][sl] - deq[i, j]
        outs = []
        for j in range(n):
            sl = slice(j * S, (j + 1) * S)
            acc = torch.zeros(S)
            for i in range(n):  # the owner adds in rank order, its own shard as g + (-h)
                if i == j:
                    acc = acc + g[j][sl]
                    acc = acc + (-self.h[j][sl])
                else:
                    acc = acc + deq[i, j]
            self.est[j] = self.est[j] + acc
            outs.append(self.est[j] / self.divisor)
        self.h = [g[i] - kept[i] for i in range(n)]
        self.started = True
        return outs

    def settled(self, g: List[torch.Tensor]) -> List[torch.Tensor]:
        """A plain call that settles the state: the exact sums, h = g (two ranks: the
        order of a plain reduce-scatter's sum over more is gloo's)."""
        assert self.n == 2, "the settled sum is written for two ranks"
        total = g[0] + g[1]
        self.est = [total[j * S:(j + 1) * S].clone() for j in range(self.n)]
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


def _cfg(fields: Dict[str, Any]) -> tagc.TAGCConfig:
    """Quant with EF21, every knob the recursion relies on named (TAGCConfig()'s
    defaults are a preset's); ``fields`` may override them."""
    base = dict(mode="quant", ef21=True, error_feedback=True, ef21_damping=True,
                quant_block=256, bypass_every=0, guard_ratio=None, dense_steps=0,
                warmup_steps=0)
    base.update(fields)
    return tagc.TAGCConfig(**base)


class StepCount:
    """Counts the calls of ``tagc.comm.Comm.stepped`` that answered True (messages in
    ring steps) while in use, so a case can show which route it took."""

    def __enter__(self) -> "StepCount":
        from tagc.comm import Comm

        self.seen: List[bool] = []
        self._orig = Comm.stepped

        def stepped(comm: Any) -> bool:
            res = self._orig(comm)
            self.seen.append(bool(res))
            return res

        Comm.stepped = stepped  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        from tagc.comm import Comm

        Comm.stepped = self._orig  # type: ignore[method-assign]

    @property
    def stepped(self) -> int:
        return sum(self.seen)


def _differ(step: int, path: str, pairs: List[Tuple[str, torch.Tensor, torch.Tensor]]
            ) -> List[str]:
    """What differs (not bit for bit) between the product's and the reference's tensors.
    Collected, not asserted at once: every rank runs every step's collectives, so a
    mismatch on some ranks only cannot desynchronise the spawn's next cases."""
    return [f"step {step} ({path}) {what}: max |diff| {float((a - b).abs().max()):.3g}"
            for what, a, b in pairs if not torch.equal(a, b)]


def _run(rank: int, n: int, fields: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(0)
    cfg = _cfg(fields)
    u = UnitReducer(cfg, UnitSpec("unit", 0, n * S, n * S, n * S, torch.device("cpu")),
                    dist.group.WORLD, rank, n, 1.0, float(n), CodecStreams())
    ref = Reference(cfg, u.pre * u.post, n)
    damps, paths, bad = [], [], []
    with StepCount() as steps:
        for step in range(STEPS):
            g = grads(step, n)
            out = torch.full((S,), float("nan"))
            settled = _settles(u, lambda: u.reduce(g[rank].clone(), out))
            paths.append("plain" if settled else "compressed")
            want = (ref.settled if settled else ref.compressed)(g)[rank]
            bad += _differ(step, paths[-1], [("output", out, want),
                                             ("h", -u.residual, ref.h[rank]),
                                             ("estimate", u.estimate, ref.est[rank])])
            if not settled:
                damps.append(u.damp)
    assert not bad, f"rank {rank}: {bad}"
    return {"damps": damps, "paths": paths, "stepped": steps.stepped}


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

    def __init__(self, cfg: tagc.TAGCConfig, n: int = N) -> None:
        super().__init__(cfg, 1.0, n)
        self.w = torch.zeros(n, S)

    def compressed(self, g: List[torch.Tensor]) -> List[torch.Tensor]:
        lam, started = self.damping(g), self.started
        est = super().compressed(g)
        if started and self.cfg.ef21_damping:
            self.w = self.w * lam
        fmt = owner_format_ref(self.cfg.quant_format, self.cfg.hsdp_out_format)
        block = self.cfg.quant_block
        for j in range(self.n):  # every replica adds every owner's decoded change
            self.w[j] = self.w[j] + _quantize(est[j] - self.w[j], fmt, block)
        return [self.w.reshape(-1).clone() for _ in range(self.n)]

    def settled(self, g: List[torch.Tensor]) -> List[torch.Tensor]:
        est = super().settled(g)
        self.w = torch.stack(est)
        return [self.w.reshape(-1).clone() for _ in range(self.n)]


def _run_two_phase(rank: int, n: int, fields: Dict[str, Any], pad: int = 0
                   ) -> Dict[str, Any]:
    """The two-phase reducer of ``n`` replicas against :class:`TwoPhaseReference`; the
    hook's shard is ``n * S - pad`` values (padded to n chunks of S by the reducer,
    with zeros by the reference)."""
    from tagc.hsdp import TwoPhaseReducer

    cfg = _cfg(fields)
    length = n * S - pad
    u = TwoPhaseReducer(cfg, UnitSpec("unit", 0, n * S, n * S, n * S, torch.device("cpu")),
                        dist.group.WORLD, rank, n, CodecStreams(), length)
    ref = TwoPhaseReference(cfg, n)
    paths, bad = [], []
    with StepCount() as steps:
        for step in range(STEPS):
            g = grads(step, n)
            for x in g:
                x[length:] = 0.0  # the padding the reducer adds
            t = g[rank][:length].clone()
            settled = _settles(u, lambda: u.hook(t))
            paths.append("plain" if settled else "compressed")
            want = (ref.settled if settled else ref.compressed)(g)[rank][:length]
            bad += _differ(step, paths[-1], [("output", t, want),
                                             ("h", -u.residual, ref.h[rank]),
                                             ("estimate", u.estimate, ref.est[rank]),
                                             ("estimate_out", u.estimate_out,
                                              ref.w.reshape(-1))])
    assert not bad, f"rank {rank}: {bad}"
    return {"paths": paths, "stepped": steps.stepped}


TWO_PHASE = {"int4": {"quant_format": "int4"},
             "ternary-undamped": {"quant_format": "ternary", "ef21_damping": False},
             "ternary-owners": {"quant_format": "ternary", "hsdp_out_format": "ternary"},
             "bypass": {"quant_format": "int4", "bypass_every": 2}}


@pytest.mark.parametrize("which", list(TWO_PHASE))
def test_two_phase_hsdp_output_matches_independent_recursion(which: str) -> None:
    """The two-phase HSDP all-reduce (2 replicas) hands FSDP the EF21-P output ``w``
    of the recursion above, bit for bit, with every state; under the bypass the
    settled calls make every estimate exact."""
    res = SPAWN.case(N, f"two_phase/{which}")
    paths = [r["paths"] for r in res]
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


# beyond two ranks (every message in ring steps): the compressed paths (a settling call's
# plain reduce-scatter sums in gloo's order, which the reference does not restate)
RECURSION_3 = {f"{fmt}/{damping}": {"quant_format": fmt, "ef21_damping": damping}
               for fmt in ("int4", "ternary") for damping in (True, False)}
TWO_PHASE_3 = {k: TWO_PHASE[k] for k in ("int4", "ternary-undamped", "ternary-owners")}


def _suite(rank: int, n: int) -> Dict[str, Tuple[str, Any]]:
    cases: List[Tuple[str, Callable[..., Any]]] = []
    if n == 3:
        cases += [(f"recursion/{k}", lambda r, w, f=f: _run(r, w, f))
                  for k, f in RECURSION_3.items()]
        cases += [(f"two_phase/{k}", lambda r, w, f=f: _run_two_phase(r, w, f, PAD))
                  for k, f in TWO_PHASE_3.items()]
        return run_cases(rank, n, cases)
    cases += [
        (f"recursion/{fmt}/{damping}",
         lambda r, w, f=fmt, d=damping: _run(r, w, {"quant_format": f, "ef21_damping": d}))
        for fmt in ("int4", "ternary") for damping in (True, False)]
    cases.append(("recursion/bypass",
                  lambda r, w: _run(r, w, {"quant_format": "int4", "bypass_every": 2})))
    cases += [(f"two_phase/{k}", lambda r, w, f=f: _run_two_phase(r, w, f))
              for k, f in TWO_PHASE.items()]
    cases.append(("device_vote", _device_vote))
    return run_cases(rank, n, cases)


SPAWN = SharedSpawn(_suite, timeout=300)  # the cases above: one spawn per world size


@pytest.mark.slow
@pytest.mark.parametrize("which", list(RECURSION_3))
def test_output_matches_independent_recursion_n3(which: str) -> None:
    """Three ranks, bit for bit: the owner adds two peers' decoded messages and its own
    exact shard in rank order, while the messages travelled in ring steps (each rank
    took the stepped route at every call); every rank's ``h`` and estimate too."""
    res = SPAWN.case(3, f"recursion/{which}")
    assert res[0] == res[1] == res[2]  # the same factors and paths on every rank
    assert res[0]["paths"] == ["compressed"] * STEPS
    assert res[0]["stepped"] >= STEPS, res[0]  # ring steps: at least once per call
    damps = res[0]["damps"]
    if RECURSION_3[which]["ef21_damping"]:
        assert damps[0] == 1.0 and all(0.0 <= d <= 1.0 for d in damps), damps
        assert min(damps[1:]) < 1.0, damps  # the damping really scaled the state
    else:
        assert all(d is None for d in damps), damps


@pytest.mark.slow
@pytest.mark.parametrize("which", list(TWO_PHASE_3))
def test_two_phase_hsdp_output_matches_independent_recursion_r3(which: str) -> None:
    """HSDP's two-phase all-reduce over R = 3 replicas, its to-the-owner phase in ring
    steps (``Comm.stepped``) and a shard padded to 3 chunks: the hook's output ``w``,
    every ``h``, estimate and held owner estimate equal the recursion's bit for bit."""
    res = SPAWN.case(3, f"two_phase/{which}")
    assert res[0] == res[1] == res[2]
    assert res[0]["paths"] == ["compressed"] * STEPS
    assert res[0]["stepped"] >= STEPS, res[0]


def test_device_vote_agrees_with_host_vote() -> None:
    res = SPAWN.case(N, "device_vote")
    assert res[0] == res[1]
