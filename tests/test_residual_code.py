"""The residual kept as block codes (``residual_code``, issue 42): what the reducers
hand to FSDP and keep, bit for bit, against an independent recursion; the memory it
takes (:mod:`tagc.memory`, ``TAGCState.stats()["memory"]``); the config's rules.

The recursion, for every rank ``i`` at once, written from the definition on
``tests/test_quant.py``'s numpy quantizer (nothing of the codec's):

* ``e_i`` is the decoded residual, ``Q_r(e)`` coded on ``residual_code`` over the
  whole unit (blocks of ``quant_block`` from its first entry, across shard edges),
  times ``residual_factor`` when a compressed call uses it;
* every other owner's shard of ``v = g_i + e_i`` goes as ``C(v)`` and leaves
  ``v - C(v)``; the own shard goes exact (its residual stays zero);
* after the call ``e_i <- Q_r(e_i)``: what the storage rounds away is dropped;
* the owner adds in rank order, its own shard as ``g``, and divides.

A reducer that fed back the un-rounded residual (fp32 kept by mistake), coded per
shard instead of over the unit, or re-coded on a call that left the state alone
fails here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

from tagc.cost import cluster
import torch.distributed as dist

import tagc_hook as tagc
from dist_helpers import SharedSpawn, build_fsdp, run_cases, toy_batch
from tagc import memory
from tagc.device import CodecStreams
from tagc.reducer import UnitReducer
from tagc.selection import UnitSpec
from test_ef21 import grads
from test_quant import encode_ref

pytest.importorskip("_tagc")

N = 2
S = 777  # odd: residual blocks straddle the shard edge
STEPS = 6


def _q(v: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """The reference quantizer's decoded code of ``v`` (blocks from its start)."""
    return torch.from_numpy(encode_ref(v.numpy(), fmt, block)[1])


def _cfg(**kw: Any) -> tagc.TAGCConfig:
    """Quant, residual feedback on int8 codes; ``kw`` overrides (``residual_code``
    ``"none"``: the fp32 residual)."""
    base = dict(mode="quant", quant_format="int4", quant_block=256, error_feedback=True,
                ef21=False, residual_code="int8", bypass_every=0, guard_ratio=0,
                dense_steps=0)
    base.update(kw)
    return tagc.TAGCConfig(**base)


class Reference:
    """Residual feedback with the residual stored on ``residual_code``, every rank."""

    def __init__(self, cfg: tagc.TAGCConfig, n: int, divisor: float) -> None:
        self.cfg, self.n, self.divisor = cfg, n, divisor
        self.e = [torch.zeros(n * S) for _ in range(n)]

    def call(self, g: List[torch.Tensor]) -> List[torch.Tensor]:
        """One compressed call; every owner's output shard."""
        fmt, block, n = self.cfg.quant_format, self.cfg.quant_block, self.n
        deq = {}
        for i in range(n):
            self.e[i] = self.e[i] * self.cfg.residual_factor
            for j in range(n):
                if i == j:
                    continue
                sl = slice(j * S, (j + 1) * S)
                v = g[i][sl] + self.e[i][sl]
                deq[i, j] = _q(v, fmt, block)
                self.e[i][sl] = v - deq[i, j]
            self.e[i] = _q(self.e[i], self.cfg.residual_code, block)
        outs = []
        for j in range(n):
            acc = torch.zeros(S)
            for i in range(n):
                acc = acc + (g[j][j * S:(j + 1) * S] if i == j else deq[i, j])
            outs.append(acc / self.divisor)
        return outs


def _decoded(u: UnitReducer, name: str, length: int) -> torch.Tensor:
    import _tagc

    out = torch.zeros(length)
    _tagc.quant_decode_add(out, getattr(u, name), u.cfg.residual_code, u.cfg.quant_block)
    return out


def _run(rank: int, n: int, fields: Dict[str, Any]) -> List[str]:
    cfg = _cfg(**fields)
    u = UnitReducer(cfg, UnitSpec("unit", 0, n * S, n * S, n * S, torch.device("cpu")),
                    dist.group.WORLD, rank, n, 1.0, float(n), CodecStreams())
    ref = Reference(cfg, n, u.pre * u.post)
    bad = []
    for step in range(STEPS):
        g = grads(step, n)
        out = torch.full((S,), float("nan"))
        u.reduce(g[rank].clone(), out)
        want = ref.call(g)[rank]
        assert u.residual.dtype == torch.uint8  # codes between calls, never fp32
        for what, a, b in (("output", out, want),
                           ("residual", _decoded(u, "residual", n * S), ref.e[rank])):
            if not torch.equal(a, b):
                bad.append(f"step {step} {what}: max |diff| {float((a - b).abs().max()):.3g}")
    # a non-finite call (the plain path) leaves the codes byte for byte as they were
    held = u.residual.clone()
    g = grads(STEPS, n)[rank].clone()
    g[3] = float("nan")
    u.reduce(g, torch.empty(S))
    if not torch.equal(u.residual, held):
        bad.append("the plain path re-coded the residual")
    return bad


class TwoPhaseReference(Reference):
    """HSDP's two-phase all-reduce with residual feedback both ways: the owner codes
    its chunk of the sum plus ``residual_out`` (stored on ``residual_code`` too) and
    every replica decodes every owner's code (tagc/hsdp.py, DoubleSqueeze)."""

    def __init__(self, cfg: tagc.TAGCConfig, n: int) -> None:
        super().__init__(cfg, n, 1.0)
        self.e_out = [torch.zeros(S) for _ in range(n)]

    def call(self, g: List[torch.Tensor]) -> List[torch.Tensor]:
        sums = super().call(g)
        block = self.cfg.quant_block
        full = torch.zeros(self.n, S)
        for j in range(self.n):
            v = sums[j] + self.e_out[j]
            full[j] = _q(v, self.cfg.out_format(), block)
            self.e_out[j] = _q(v - full[j], self.cfg.residual_code, block)
        return [full.reshape(-1).clone() for _ in range(self.n)]


def _run_two_phase(rank: int, n: int, fields: Dict[str, Any]) -> List[str]:
    from tagc.hsdp import TwoPhaseReducer

    cfg = _cfg(**fields)
    u = TwoPhaseReducer(cfg, UnitSpec("unit", 0, n * S, n * S, n * S, torch.device("cpu")),
                        dist.group.WORLD, rank, n, CodecStreams(), n * S)
    ref = TwoPhaseReference(cfg, n)
    bad = []
    for step in range(STEPS):
        g = grads(step, n)
        t = g[rank].clone()
        u.hook(t)
        want = ref.call(g)[rank]
        for what, a, b in (("output", t, want),
                           ("residual", _decoded(u, "residual", n * S), ref.e[rank]),
                           ("residual_out", _decoded(u, "residual_out", S), ref.e_out[rank])):
            if not torch.equal(a, b):
                bad.append(f"step {step} {what}: max |diff| {float((a - b).abs().max()):.3g}")
    # a loss-scale change halves both coded residuals (a power of two: the codes stay,
    # the scales halve, so exactly) and leaves them codes
    before = {n: _decoded(u, n, ln) for n, ln in (("residual", n * S), ("residual_out", S))}
    u.scale_feedback(0.5)
    for name, was in before.items():
        if getattr(u, name).dtype != torch.uint8:
            bad.append(f"scale_feedback left {name} as {getattr(u, name).dtype}")
        elif not torch.equal(_decoded(u, name, was.numel()), was * 0.5):
            bad.append(f"scale_feedback: {name} is not half of what it was")
    return bad


def _stats_memory(rank: int, n: int) -> Dict[str, Any]:
    """stats()["memory"] of an FSDP2 model: nothing before the first compressed call,
    then every compressed unit's codes, as tagc.memory says; per parameter of the model."""
    cfg = _cfg(residual_code="int4", min_numel=64, layers="all")
    model = build_fsdp("fsdp2", cfg)
    state = tagc.register(model, cfg)
    first = state.stats()["memory"]
    model(toy_batch(rank, 0)).backward()
    mem = state.stats()["memory"]
    want = sum(memory.coded_bytes(u.flat_numel, "int4", 256)
               for u in state.units if u.compressed)
    return {"first": first["feedback_bytes"], "held": mem["feedback_bytes"],
            "steady": mem["feedback_bytes_steady"], "want": want, "params": mem["params"],
            "model_params": sum(p.numel() for p in model.parameters()),
            "per_param": mem["feedback_bytes_per_param"]}


CASES = {"int8": {}, "int4": {"residual_code": "int4"},
         "int4-factor": {"residual_code": "int4", "residual_factor": 0.3},
         "ternary-int4": {"quant_format": "ternary", "residual_code": "int4"}}


def _suite(rank: int, n: int) -> Dict[str, Tuple[str, Any]]:
    cases = [(f"recursion/{k}", lambda r, w, f=f: _run(r, w, f)) for k, f in CASES.items()]
    cases += [(f"two_phase/{k}", lambda r, w, f=f: _run_two_phase(r, w, f))
              for k, f in CASES.items()]
    cases.append(("stats_memory", _stats_memory))
    return run_cases(rank, n, cases)


SPAWN = SharedSpawn(_suite, timeout=300)


@pytest.mark.parametrize("which", list(CASES))
def test_output_and_codes_match_independent_recursion(which: str) -> None:
    for bad in SPAWN.case(N, f"recursion/{which}"):
        assert not bad, bad


@pytest.mark.parametrize("which", list(CASES))
def test_two_phase_hsdp_matches_independent_recursion(which: str) -> None:
    for bad in SPAWN.case(N, f"two_phase/{which}"):
        assert not bad, bad


# ----------------------------------------------------------------------------- memory

def test_stats_report_the_feedback_memory() -> None:
    for r in SPAWN.case(N, "stats_memory"):
        assert r["first"] == 0 and r["want"] > 0, r
        assert r["held"] == r["steady"] == r["want"], r
        assert r["params"] == r["model_params"], r
        assert r["per_param"] == r["want"] / r["params"] and r["per_param"] < 1.0, r


@pytest.mark.parametrize("code,per_entry", [("none", 4.0), ("int8", 260 / 256),
                                            ("int4", 132 / 256)])
def test_feedback_bytes_per_format(code: Any, per_entry: float) -> None:
    """Residual feedback: the residual over the unit, nothing else (FULL_SHARD)."""
    n = 1 << 16
    cfg = _cfg(residual_code=code)
    assert cluster.feedback_bytes(cfg, n, 4) == per_entry * n


def test_feedback_bytes_ef21_and_none() -> None:
    n, world = 3 * 1024, 3
    ef21 = _cfg(residual_code="none", ef21=True)
    assert cluster.feedback_bytes(ef21, n, world) == 4 * n + 4 * n // world
    assert cluster.feedback_bytes(_cfg(error_feedback=False), n, world) == 0
    assert cluster.feedback_bytes(_cfg(mode="dense"), n, world) == 0


def test_feedback_bytes_hsdp_two_phase() -> None:
    """R = 4 replicas of a shard of 2^16 / 8: the residual over the shard and the
    owner's residual_out over its chunk, both on int4 codes."""
    cfg = _cfg(residual_code="int4", hsdp_allreduce="two_phase")
    shard = (1 << 16) // 8
    want = memory.coded_bytes(shard, "int4", 256) + memory.coded_bytes(shard // 4, "int4", 256)
    assert cluster.feedback_bytes(cfg, 1 << 16, 8, replicas=4) == want


def test_unit_buffers_are_what_reducers_keep() -> None:
    cfg = _cfg(residual_code="int4")
    u = UnitReducer(cfg, UnitSpec("unit", 0, 2 * S, 2 * S, 2 * S, torch.device("cpu")),
                    None, 0, 2, 1.0, 2.0, CodecStreams())
    assert u.feedback_buffers() == [("residual", memory.coded_bytes(2 * S, "int4", 256),
                                     torch.uint8)]


# ----------------------------------------------------------------------------- config

def test_residual_code_rules() -> None:
    # derived: int4 codes for quant's residual feedback, values elsewhere
    assert tagc.TAGCConfig().residual_code == "int4"
    assert tagc.TAGCConfig(ef21=True).residual_code == "none"
    assert tagc.TAGCConfig(mode="sparse").residual_code == "none"
    assert tagc.TAGCConfig(residual_dtype="bfloat16").residual_code == "none"
    assert tagc.TAGCConfig(error_feedback=False).residual_code == "none"
    # it follows its source when not given (to_dict writes it as None)
    assert tagc.TAGCConfig().replace(ef21=True).residual_code == "none"
    assert tagc.TAGCConfig(residual_code="int8").replace(seed=3).residual_code == "int8"
    with pytest.raises(ValueError, match="^residual_code"):
        tagc.TAGCConfig(residual_code="int3")
    with pytest.raises(ValueError, match="^residual_code"):
        tagc.TAGCConfig(residual_code="ternary")
    with pytest.raises(ValueError, match="^residual_code"):
        tagc.TAGCConfig(residual_code="int8", ef21=False, residual_dtype="bfloat16")
    with pytest.raises(ValueError, match="^ef21"):
        tagc.TAGCConfig(residual_code="int8", ef21=True)
    # no residual kept: nothing to code, as residual_dtype
    assert tagc.TAGCConfig(mode="dense", residual_code="int4").residual_code == "int4"
