"""The 124M quality run's simulation of two ranks (``tagc_bench.gpu_quality``, issue 57
item 4) against the hook itself: the simulated exchange must give each owner what the
hook's reducer gives on two real gloo ranks fed the same gradients, bit for bit, step
after step (the feedback state carried); and the script's CPU check must run and report.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, List

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = [pytest.mark.codec, pytest.mark.dist]

import tagc_hook as tagc
from dist_helpers import run_dist
from tagc.train.model import GPT, GPTConfig
from tagc_bench import gpu_quality
from tagc_bench.cuda_hook import unit_reducers

STEPS = 3
REPO = Path(__file__).resolve().parents[1]


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, vocab_size=512, n_layer=1, n_head=2, n_embd=128))


def rank_rows(rows_len: int, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, rows_len, generator=g) * (1 + step)


def _hook_side(rank: int, world: int, preset: str, lengths: List[int]) -> List[List[Any]]:
    cfg = tagc.TAGCConfig.preset(preset)
    outs = []
    units = unit_reducers(cfg, [world * s for s in lengths], torch.device("cpu"), world,
                          group=dist.group.WORLD, rank=rank)
    for u, s in zip(units, lengths):
        per = []
        for step in range(STEPS):
            out = torch.empty(s)
            u.reduce(rank_rows(s, step, rank).reshape(-1), out)
            assert u.unit_call  # the path the simulation stands for
            per.append(out)
        outs.append(per)
    return outs


@pytest.mark.parametrize("preset", ["balanced", "full"])
def test_simulated_exchange_is_the_hooks(preset: str) -> None:
    sim = gpu_quality.SimRanks(tiny(), preset, torch.device("cpu"))
    units = [i for i, c in enumerate(sim.compressed) if c]
    assert units
    lengths = [sim.units[i].row for i in units]
    hook = run_dist(_hook_side, 2, preset, lengths, timeout=120)
    for k, i in enumerate(units):
        for step in range(STEPS):
            got = sim.reduce_unit(i, [rank_rows(lengths[k], step, r) for r in range(2)])
            for r in range(2):
                assert torch.equal(got[r], hook[r][k][step]), (sim.units[i].name, step, r)


@pytest.mark.parametrize("preset", ["balanced", "full"])
def test_simulation_cuda_branch_under_the_emulation(cuda_emu_library: Path, preset: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation's CUDA branch (the ranks' vote, the unit encode's counts and flags,
    the gathers' device segments) with the kernels emulated on CPU tensors: the CPU
    branch's gradients, residual codes and gathered weights bit for bit; a NaN in one
    rank's gradient poisons every compressed unit's gradient and keeps the codes."""
    from tagc_bench import cuda_emu

    cpu_model, emu_model = tiny(), tiny()
    cpu = gpu_quality.SimRanks(cpu_model, preset, torch.device("cpu"))
    emu = gpu_quality.SimRanks(emu_model, preset, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=g) for u in cpu.units for p in u.params]
             for _ in range(2)]  # per rank, in the units' order
    cpu.reduce(grads)
    want_gathered = cpu.gathered()
    emu.cuda, emu.counts = True, torch.zeros(5, dtype=torch.int64)
    emu.flags = torch.zeros(2, dtype=torch.int32)
    monkeypatch.setattr(gpu_quality, "_tagc", cuda_emu.EmuOps(cuda_emu_library))
    monkeypatch.setattr(emu, "_kw", lambda: {"stream": 0})
    emu.reduce(grads)
    for a, b in zip(emu_model.parameters(), cpu_model.parameters()):
        assert torch.equal(a.grad, b.grad)
    for i in range(len(emu.units)):
        assert all(torch.equal(a, b) for a, b in zip(emu.codes[i], cpu.codes[i]))
    got = emu.gathered()
    assert len(got) == len(want_gathered) == (0 if preset == "balanced" else
                                              sum(len(u.params) for u in emu.units))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(got, want_gathered))
    kept = [[c.clone() for c in codes] for codes in emu.codes]
    grads[1][0][0] = float("nan")
    emu.reduce(grads)
    units = [i for i, c in enumerate(emu.compressed) if c]
    for i in units:
        assert all(p.grad.isnan().all() for p in emu.units[i].params), emu.units[i].name
        assert all(torch.equal(a, b) for a, b in zip(emu.codes[i], kept[i]))
    # the sizes count the finite call's encodes only (each simulated rank's, every unit)
    slots = 2 * sum(emu.units[i].row for i in units)
    assert emu.counts.tolist() == [2 * len(units), 2 * len(units), 0, slots, slots]
    assert emu.flags.tolist() == [0, 0]


@pytest.mark.slow
def test_dry_run_runs_and_reports(tmp_path: Path) -> None:
    """``scripts/gpu_quality.sh --dry-run``: the CPU, a tiny shape, six steps."""
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_quality.sh"), "--dry-run",
                          "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=600, env={k: v for k, v in os.environ.items() if k != "OUT"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_quality.json").read_text())
    assert [r["preset"] for r in out["runs"]] == ["plain", "balanced", "full"]
    for r in out["runs"]:
        assert len(r["curve"]) == 6 and [s for s, _ in r["val"]] == [3, 6]
        assert all(v == v and v < 10 for v in r["curve"])  # finite, learning-sized
    assert out["runs"][1]["compressed_units"] > 0
    # two real processes (FSDP2, the hook) give the simulation's losses
    assert set(out["tie"]) == {"plain", "balanced", "full"}
    for preset, t in out["tie"].items():
        assert t["steps"] == 3 and t["ok"] and t["max_abs_diff"] < 1e-4, (preset, t)
    text = (tmp_path / "gpu_quality.md").read_text()
    assert "| balanced |" in text and "vs plain" in text and "within" in text
