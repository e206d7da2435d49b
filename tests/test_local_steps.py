"""Local steps on TAGC's HSDP route (``outer_every``, tagc/local.py, issue 41): two
replicas of one rank each (gloo), a ToyGPT, SGD inside.

Cases: with ``dense`` the parameters after two rounds equal an independent one-process
reference bit for bit (two plain ``nn.Module`` replicas trained apart, the average of
their changes, torch's Nesterov update written out); with int4 codes and no feedback
every unit's all-reduced pseudo-gradient equals :func:`test_hsdp.reference_allreduce`;
the bytes counted at the call equal the cost model's ``hsdp+local`` prediction;
with the shipped preset's feedback the replicas end every round bit-identical; nothing
crosses between the replicas during the inner steps; a non-finite pseudo-gradient on
one replica skips the outer step on both and puts every shard back at the round's
start; resume in the middle of a round (torch.save per rank) is bitwise; misuse raises.
"""
from __future__ import annotations

import copy
import os
import tempfile
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import tagc_hook as tagc
from dist_helpers import SharedSpawn, ToyGPT, run_cases, run_dist, toy_batch
from test_hsdp import _tap, reference_allreduce

pytestmark = [pytest.mark.codec, pytest.mark.dist]
R, H, LR = 2, 3, 0.1


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (R, 1), mesh_dim_names=("replicate", "shard"))


def _cfg(mode: str = "quant", **kw: Any) -> tagc.TAGCConfig:
    kw.setdefault("min_numel", 64)
    return tagc.TAGCConfig(mode=mode, outer_every=H, outer_lr=0.7, outer_momentum=0.9, **kw)


def _build(cfg: tagc.TAGCConfig) -> Tuple[Any, Any, Any]:
    torch.manual_seed(0)
    mesh = _mesh()
    model = tagc.shard_model(ToyGPT(), cfg, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return model, opt, tagc.register(model, cfg, mesh=mesh, optimizer=opt)


def _local(p: Any) -> torch.Tensor:
    return (p._local_tensor if hasattr(p, "_local_tensor") else p.data).detach()


def _train(model: Any, opt: Any, rank: int, steps: range) -> None:
    for i in steps:
        model(toy_batch(rank, i)).backward()
        opt.step()
        opt.zero_grad()


def _reference(rounds: int) -> List[torch.Tensor]:
    """DiLoCo in one process: R plain replicas, H SGD steps each on the data their
    rank sees, then the average change and the Nesterov step, per parameter."""
    torch.manual_seed(0)
    base = ToyGPT()
    start = [p.detach().clone() for p in base.parameters()]
    mom = [torch.zeros_like(p) for p in start]
    step = 0
    for _ in range(rounds):
        ends = []
        for r in range(R):
            m = copy.deepcopy(base)
            with torch.no_grad():
                for p, s in zip(m.parameters(), start):
                    p.copy_(s)
            opt = torch.optim.SGD(m.parameters(), lr=LR)
            for i in range(step, step + H):
                m(toy_batch(r, i)).backward()
                opt.step()
                opt.zero_grad()
            ends.append([p.detach().clone() for p in m.parameters()])
        step += H
        for k in range(len(start)):
            d = (start[k] - ends[0][k]) + (start[k] - ends[1][k])  # the all-reduce's SUM
            d = d / R
            mom[k].mul_(0.9).add_(d)
            start[k] = start[k].sub(d.add(mom[k], alpha=0.9), alpha=0.7)
    return start


def _streamed_reference(frag_of: List[int], steps: int, h: int, tau: int,
                        alpha: float) -> List[torch.Tensor]:
    """Streaming DiLoCo in one process, per parameter: parameter k belongs to fragment
    ``frag_of[k]``; fragment p syncs at steps p h // P + j h (j >= 1), its average taken
    then and its outer step applied tau steps later, each replica's parameter becoming
    global + alpha (local - global).  Returns every replica's parameters."""
    torch.manual_seed(0)
    base = ToyGPT()
    start = [p.detach().clone() for p in base.parameters()]
    mom = [torch.zeros_like(p) for p in start]
    reps = [copy.deepcopy(base) for _ in range(R)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in reps]
    parts = max(frag_of) + 1
    flight = None  # (fragment, merge step, averages)
    for t in range(1, steps + 1):
        for r in range(R):
            reps[r](toy_batch(r, t - 1)).backward()
            opts[r].step()
            opts[r].zero_grad()
        params = [list(m.parameters()) for m in reps]
        if flight is not None and flight[1] == t:
            p, _, avg = flight
            flight = None
            for k, d in avg.items():
                mom[k].mul_(0.9).add_(d)
                start[k] = start[k].sub(d.add(mom[k], alpha=0.9), alpha=0.7)
                with torch.no_grad():
                    for r in range(R):
                        local = params[r][k].detach().clone()
                        new = start[k].add(local - start[k], alpha=alpha) if alpha else start[k]
                        params[r][k].copy_(new)
        for p in range(parts):
            off = p * h // parts
            if t - off >= h and (t - off) % h == 0:
                avg = {k: ((start[k] - params[0][k].detach()) + (start[k] - params[1][k].detach()))
                       / R for k in range(len(start)) if frag_of[k] == p}
                assert tau, "the reference streams: tau >= 1"
                flight = (p, t + tau, avg)
    return [[p.detach().clone() for p in m.parameters()] for m in reps]


def _streamed(rank: int, n: int) -> int:
    """dense, H = 4, two fragments, tau = 1, alpha = 0.5: every parameter after 13
    steps (the last merge included) equals :func:`_streamed_reference` bit for bit;
    the outer state agrees across the replicas, the parameters by design do not."""
    h, tau, alpha = 4, 1, 0.25
    cfg = tagc.TAGCConfig(mode="dense", min_numel=64, outer_every=h, outer_fragments=2,
                          outer_overlap=tau, outer_mix=alpha)
    torch.manual_seed(0)
    mesh = _mesh()
    model = tagc.shard_model(ToyGPT(), cfg, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = tagc.register(model, cfg, mesh=mesh, optimizer=opt)
    from tagc import fsdp2
    local = state.local
    assert len(local.fragments) == 2 and local.offsets == [0, 2]
    frag = {}
    for p, idx in enumerate(local.fragments):
        for i in idx:
            for fp in fsdp2.unit_params(local.mods[i]):
                frag[id(fp.sharded_param)] = p
    frag_of = [frag[id(p)] for p in model.parameters()]
    _train(model, opt, rank, range(13))
    want = _streamed_reference(frag_of, 13, h, tau, alpha)[rank]
    for i, (p, w) in enumerate(zip(model.parameters(), want)):
        assert torch.equal(_local(p), w), (i, float((_local(p) - w).abs().max()))
    assert not _params_agree(model, local.group)  # alpha > 0: apart by design
    return len(frag_of)


def _dense_reference(rank: int, n: int) -> int:
    model, opt, state = _build(_cfg("dense"))
    _train(model, opt, rank, range(2 * H))
    want = _reference(2)
    got = [_local(p) for p in model.parameters()]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (i, float((a - b).abs().max()))
    st = state.stats()["total"]
    # two outer all-reduces per unit and nothing else between the replicas
    assert st["calls"] == 2 * len(state.units), st["calls"]
    # what the reducers hold is what tagc.memory (the cluster table's count) says
    from tagc import memory
    assert state.memory()["outer_bytes"] == sum(
        memory.outer_bytes(state.cfg, u.shard_numel, 1, R) for u in state.units) > 0
    return len(got)


def _int4_reference(rank: int, n: int) -> int:
    cfg = _cfg(error_feedback=False)
    model, opt, state = _build(cfg)
    seen = _tap(state)
    _train(model, opt, rank, range(H))
    group = state.local.group
    checked = 0
    for u in state.units:
        if not u.compressed:
            continue
        x, got = seen[u.name]
        every = [torch.empty_like(x) for _ in range(R)]
        dist.all_gather(every, x, group=group)
        want = reference_allreduce(every, cfg, "gather")
        assert torch.equal(got, want), (u.name, float((got - want).abs().max()))
        checked += 1
    assert checked
    return checked


def _params_agree(model: Any, group: Any) -> bool:
    flat = torch.cat([_local(p).reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(R)]
    dist.all_gather(every, flat, group=group)
    return all(torch.equal(e, every[0]) for e in every)


def _preset_agree(rank: int, n: int) -> List[bool]:
    cfg = tagc.TAGCConfig.preset("tagc-balanced").replace(
        min_numel=64, outer_every=H, outer_lr=0.7, outer_momentum=0.9)
    model, opt, state = _build(cfg)
    agree = []
    for k in range(3):
        _train(model, opt, rank, range(k * H, k * H + H - 1))
        agree.append(_params_agree(model, state.local.group))  # mid-round: apart
        _train(model, opt, rank, range(k * H + H - 1, k * H + H))
        agree.append(_params_agree(model, state.local.group))  # after the round: equal
    assert agree == [False, True] * 3, agree
    return agree


def _nonfinite(rank: int, n: int) -> bool:
    model, opt, state = _build(_cfg())
    _train(model, opt, rank, range(H))  # one clean round
    start = [u.outer_start.clone() for u in state.units]
    mom = [u.outer_momentum.clone() for u in state.units]
    _train(model, opt, rank, range(H, 2 * H - 1))
    if rank == 1:
        with torch.no_grad():
            _local(next(model.parameters())).view(-1)[0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        applied = state.local.outer_step()
    assert not applied
    for u, s, m in zip(state.units, start, mom):
        assert torch.equal(u.outer_start, s) and torch.equal(u.outer_momentum, m)
    assert _params_agree(model, state.local.group)
    assert state.local.step == 2 * H - 1
    return applied


def _bytes_model(rank: int, n: int) -> float:
    """The bytes the hook counts at the call over two rounds equal the cost model's
    hsdp+local prediction per step (tagc.cost) times the steps."""
    import tagc.cost as cm

    cfg = tagc.TAGCConfig.preset("tagc-local").replace(min_numel=64, outer_every=H)
    model, opt, state = _build(cfg)
    _train(model, opt, rank, range(2 * H))
    spec = cm.ModelSpec("toy", tuple(cm.Unit(u.name, ((u.shard_numel, 1),), u.compressed)
                                     for u in state.units))
    comp = cm.Compression("quant", "int4", residual_code="int4", outer_every=H)
    p = cm.predict(spec, cm.Cluster(1, R, 100.0, 10.0), cm.Config("local", "hsdp", comp))
    assert set(p.ideal) == {"cross", "control"}
    got = state.stats()["total"]["wire_bytes"]
    assert got == pytest.approx(2 * H * p.ideal_bytes_per_rank, rel=1e-12), \
        (got, 2 * H * p.ideal_bytes_per_rank)
    return got


def _misuse(rank: int, n: int) -> str:
    torch.manual_seed(0)
    mesh = _mesh()
    cfg = _cfg()
    model = tagc.shard_model(ToyGPT(), cfg, mesh=mesh)
    with pytest.raises(ValueError, match="outer_every"):
        tagc.register(model, cfg, mesh=mesh)  # no optimizer
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match="optimizer= is for local steps"):
        tagc.register(model, cfg.replace(outer_every=0), mesh=mesh, optimizer=opt)
    plain = tagc.shard_model(ToyGPT(), cfg)
    with pytest.raises(ValueError, match="custom HSDP"):
        tagc.register(plain, cfg, optimizer=opt)
    return "ok"


def _suite(rank: int, n: int) -> Dict[str, Tuple[str, Any]]:
    warnings.filterwarnings("ignore")
    return run_cases(rank, n, [("dense_reference", _dense_reference),
                               ("int4_reference", _int4_reference),
                               ("preset_agree", _preset_agree),
                               ("nonfinite", _nonfinite),
                               ("bytes_model", _bytes_model),
                               ("streamed", _streamed),
                               ("misuse", _misuse)])


_SPAWN = SharedSpawn(_suite, timeout=300)


@pytest.mark.parametrize("case", ["dense_reference", "int4_reference", "preset_agree",
                                  "nonfinite", "bytes_model", "streamed", "misuse"])
def test_local_steps(case: str) -> None:
    _SPAWN.case(R, case)


def _snapshot(model: Any, opt: Any, state: Any) -> Dict[str, Any]:
    return {"params": [_local(p).clone() for p in model.parameters()],
            "tagc": state.state_dict()}


# (config, steps straight, steps before the checkpoint): mid-round (4 of 2 x 3 inner
# steps); streamed with a sync in flight (fragment 0 launched at step 4, merged at 5)
RESUME = {"mid_round": (dict(outer_every=H), 2 * H, H + 1),
          "in_flight": (dict(outer_every=4, outer_fragments=2, outer_overlap=1,
                             outer_mix=0.5), 9, 4)}


def _resume(rank: int, n: int, tmp: str) -> Dict[str, List[bool]]:
    """A straight run against one that saves, builds everything anew, loads and goes
    on (torch.save per rank; plain SGD, so the optimizer holds nothing)."""
    warnings.filterwarnings("ignore")
    out = {}
    for which, (knobs, steps, at) in RESUME.items():
        cfg = tagc.TAGCConfig.preset("tagc-balanced").replace(
            min_numel=64, outer_lr=0.7, outer_momentum=0.9, **knobs)
        model, opt, state = _build(cfg)
        _train(model, opt, rank, range(steps))
        straight = [_local(p).clone() for p in model.parameters()]
        model, opt, state = _build(cfg)
        _train(model, opt, rank, range(at))
        path = os.path.join(tmp, f"{which}-{rank}.pt")
        torch.save(_snapshot(model, opt, state), path)
        model, opt, state = _build(cfg)
        ck = torch.load(path, weights_only=False)
        with torch.no_grad():
            for p, saved in zip(model.parameters(), ck["params"]):
                _local(p).copy_(saved)
        state.load_state_dict(ck["tagc"])
        assert state.local.step == at
        # the sync in flight came back as its saved average, merged at its step
        assert any(u.outer_avg is not None for u in state.units) == (which == "in_flight")
        _train(model, opt, rank, range(at, steps))
        out[which] = [torch.equal(_local(p), s) for p, s in zip(model.parameters(), straight)]
    return out


def test_local_steps_resume_mid_round_and_in_flight() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for res in run_dist(_resume, R, tmp, timeout=300):
            for which, same in res.items():
                assert all(same), (which, same)


def test_outer_knobs_validate() -> None:
    for bad in (dict(outer_every=-1), dict(outer_every=1.5), dict(outer_lr=0),
                dict(outer_lr=float("nan")), dict(outer_momentum=1.0),
                dict(outer_momentum=-0.1), dict(outer_momentum=True),
                dict(outer_every=4, outer_fragments=0), dict(outer_every=4, outer_fragments=5),
                dict(outer_every=4, outer_fragments=2, outer_overlap=2),
                dict(outer_overlap=1), dict(outer_fragments=2), dict(outer_mix=0.5),
                dict(outer_every=4, outer_mix=1.0), dict(outer_every=4, outer_overlap=-1)):
        with pytest.raises(ValueError, match="outer_"):
            tagc.TAGCConfig(**bad)
    assert tagc.TAGCConfig().outer_every == 0
    tagc.TAGCConfig(outer_every=4, outer_fragments=2, outer_overlap=1, outer_mix=0.5)


def test_fragments_split_by_size_in_order() -> None:
    from tagc.local import fragments

    assert fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert fragments([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert fragments([5], 3) == [[0]]
    assert fragments([1, 1, 1], 1) == [[0, 1, 2]]


def test_local_quality_table_and_doc(tmp_path: "Path") -> None:
    """local_quality.py: each run against its task's native HSDP run at the end, the
    losses at fifths of the steps, the bytes as a fraction of native's; the doc's marked
    part replaced; every run's outer settings are valid knobs."""
    from pathlib import Path

    from script_helpers import load_script
    from tagc.config import TAGCConfig
    from tagc_bench.outputs import write_between
    lq = load_script("local_quality")
    for name, outer in lq.RUNS.items():
        if isinstance(outer, tuple):
            TAGCConfig.preset("local").replace(**lq.knobs(outer))
    steps = lq.TASKS["tiny-r2"][0]
    curve = [(s, 3.0 - s / steps) for s in range(0, steps + 1, 50)]
    runs = [{"task": "tiny-r2", "run": "native", "final": 2.0, "curve": curve,
             "bytes_per_step": 6.8e6, "outer": None, "seconds": 600, "commit": "abc"},
            {"task": "tiny-r2", "run": "h8-avg", "final": 2.05,
             "curve": [(s, v * 1.025) for s, v in curve], "bytes_per_step": 6.8e4,
             "outer": (8, 1.0, 0.0), "seconds": 300, "commit": "abc"},
            {"task": "tiny-r2", "run": "h32-p4-t2-a0.5", "final": 2.1, "curve": curve,
             "bytes_per_step": 6.8e3, "outer": lq.RUNS["h32-p4-t2-a0.5"], "seconds": 300,
             "commit": "abc"}]
    text = lq.table(runs)
    assert "| tiny-r2 | H = 32, lr 1.0, mu 0.5, P = 4, tau = 2, alpha = 0.5 | 7 KB (1/1000) |" \
        in text, text
    assert "| tiny-r2 | H = 8, lr 1.0, mu 0.0 | 68 KB (1/100) | 2.8700 / 2.6650 / 2.4600 / " \
           "2.2550 / 2.0500 | +2.50% | 5 min (abc) |" in text, text
    assert "| tiny-r2 | native HSDP | 6800 KB | 2.8000 / 2.6000 / 2.4000 / 2.2000 / 2.0000 " \
           "| +0.00% |" in text, text
    doc = Path(tmp_path) / "d.md"
    doc.write_text(f"a\n{lq.MARK[0]}\nold\n{lq.MARK[1]}\nb\n")
    write_between(doc, "new", lq.MARK)
    assert doc.read_text() == f"a\n{lq.MARK[0]}\nnew\n{lq.MARK[1]}\nb\n"
    lq.plot(runs, Path(tmp_path) / "c.png")
    assert (Path(tmp_path) / "c.png").stat().st_size > 0
