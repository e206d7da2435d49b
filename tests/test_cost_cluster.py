"""The cluster table (tagc.cost.cluster, ``cost_model.py --cluster``): its output
parses, speed-ups are the printed step times' ratio, memory verdicts follow the GPU's
memory, TAGC's feedback memory is tagc.memory's, bad input is refused clearly.

Fast: small models and node counts, one interpreter.
"""
from __future__ import annotations

import json
import math
from typing import Dict, List

import pytest

from tagc.cost import cli
from tagc.cost import cluster as cl
from tagc.config import TAGCConfig

pytestmark = pytest.mark.codec  # the model sizes messages by the _tagc codec


COLUMNS = ["model", "NIC Gbit/s", "nodes", "GPUs", "layout", "config", "step s",
           "vs plain bf16", "inter-node MB/GPU", "memory GiB/GPU", "fits", "bound"]


def run_table(argv: List[str], capsys: pytest.CaptureFixture) -> List[Dict[str, str]]:
    """The table rows ``cost_model.py --cluster ARGV`` prints, as dicts by column."""
    assert cli.main(["--cluster", *argv]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == COLUMNS
    return [dict(zip(head, (c.strip() for c in x.strip("|").split("|")))) for x in lines[1:]]


def run_json(argv: List[str], capsys: pytest.CaptureFixture) -> dict:
    """``cost_model.py --cluster ARGV --json`` parsed."""
    assert cli.main(["--cluster", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_table_parses_and_speedup_is_the_ratio_of_printed_steps(
        capsys: pytest.CaptureFixture) -> None:
    rows = run_table(["--models", "124m,7b", "--nodes", "1,4", "--nic-gbit", "25"], capsys)
    # 2 models x 2 node counts x 2 layouts x (plain + 2 presets)
    assert len(rows) == 2 * 2 * 2 * 3
    base: Dict[tuple, float] = {}
    for r in rows:
        step = float(r["step s"])
        assert step > 0 and r["fits"] in ("yes", "NO")
        assert r["bound"] in ("compute", "inter-node link", "intra-node link", "codec")
        assert float(r["memory GiB/GPU"]) > 0 and float(r["inter-node MB/GPU"]) >= 0
        assert int(r["GPUs"]) == 8 * int(r["nodes"])
        key = (r["model"], r["nodes"], r["layout"])
        if r["config"] == cl.PLAIN:
            base[key] = step
            assert r["vs plain bf16"] == "1.00x"
        else:
            assert r["config"] in ("tagc-full", "tagc-balanced")
            # the printed speed-up is plain's printed step over this one (4 digits each)
            assert float(r["vs plain bf16"].rstrip("x")) == pytest.approx(base[key] / step,
                                                                          abs=0.006)
        if r["nodes"] == "1":
            assert r["inter-node MB/GPU"] == "0"
    # HSDP across nodes: TAGC sends fewer bytes between nodes than plain bf16
    hs = {r["config"]: float(r["inter-node MB/GPU"]) for r in rows
          if (r["model"], r["nodes"], r["layout"]) == ("7b", "4", "HSDP")}
    assert hs["tagc-balanced"] < hs[cl.PLAIN] / 3


def test_assumptions_are_printed_and_explain_names_the_bound(
        capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--cluster", "--models", "124m", "--nodes", "2", "--nic-gbit", "10",
                     "--mfu", "0.3", "--mfu-source", "our last run", "--explain"]) == 0
    out = capsys.readouterr().out
    for text in ("MFU 0.3 (our last run)", "NCCL efficiency 0.8", "28x measured on an H200",
                 "16 bytes per parameter", "Korthikanti", "tagc.cost.cluster.feedback_bytes",
                 "not measurements"):
        assert text in out, text
    explain = out.split("## Explain")[1]
    lines = [x for x in explain.splitlines() if x.startswith("- ")]
    assert len(lines) == 2 * 3
    assert all(" bound by " in x and "TAGC feedback" in x for x in lines)


def test_memory_verdict_flips_when_the_gpu_shrinks(capsys: pytest.CaptureFixture) -> None:
    argv = ["--models", "7b", "--nodes", "1", "--nic-gbit", "25"]
    big = run_json([*argv, "--gpu-mem-gb", "80"], capsys)["cells"]
    small = run_json([*argv, "--gpu-mem-gb", "16"], capsys)["cells"]
    plain = [c for c in big if c["config"] == cl.PLAIN]
    assert all(c["fits"] for c in plain)
    assert not any(c["fits"] for c in small)
    for b, s in zip(big, small):  # the same need; only the limit moved
        assert b["memory_gib"]["total"] == s["memory_gib"]["total"]
        assert s["memory_gib"]["limit"] == pytest.approx(16 * 0.9)
        assert s["fits"] == (s["memory_gib"]["total"] <= s["memory_gib"]["limit"])


def test_feedback_memory_is_the_feedback_bytes_of_each_unit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The table asks feedback_bytes (tagc.memory's layout) for every compressed unit, with the unit's size, the
    GPUs it is sharded over and HSDP's replicas, and adds up what it says."""
    calls = []

    def fake(cfg: TAGCConfig, numel: int, world: int, replicas: int = 1) -> int:
        calls.append((numel, world, replicas))
        return 7 * numel + world + 1000 * replicas

    monkeypatch.setattr(cl, "feedback_bytes", fake)
    s = cl.shape("124m")
    cfg = TAGCConfig.preset("tagc-full")
    model = s.layout(cfg.layers, cfg.min_numel)
    comp = [u.numel for u in model.units if u.compressed]
    a = cl.Assumptions()
    fs = cl.memory_per_gpu(s, model, False, 4, 8, 80.0, 1024, a, cfg)
    assert calls == [(n, 32, 1) for n in comp]
    assert fs.feedback == sum(7 * n + 32 + 1000 for n in comp)
    calls.clear()
    hs = cl.memory_per_gpu(s, model, True, 4, 8, 80.0, 1024, a, cfg)
    assert calls == [(n, 8, 4) for n in comp]
    assert hs.feedback == sum(7 * n + 8 + 4000 for n in comp)
    assert cl.memory_per_gpu(s, model, False, 4, 8, 80.0, 1024, a, None).feedback == 0


def test_feedback_memory_by_hand_for_ef21_with_an_fp32_residual() -> None:
    """An EF21 config with an fp32 residual (what tagc-balanced held before
    residual_code): per compressed unit of n over W GPUs, a residual over the whole
    padded unit and an fp32 estimate of the own shard, 4 (ceil(n/W) W + ceil(n/W))."""
    cfg = TAGCConfig(mode="quant", quant_format="int4", ef21=True, layers="all")
    s = cl.shape("124m")
    model = s.layout("all", cfg.min_numel)
    w = 16
    want = sum(4 * (math.ceil(u.numel / w) * w + math.ceil(u.numel / w))
               for u in model.units if u.compressed)
    got = cl.memory_per_gpu(s, model, False, 2, 8, 80.0, 1024, cl.Assumptions(), cfg)
    assert got.feedback == want
    assert want > 4 * s.params  # unsharded: more than 4 bytes per parameter on every GPU


def test_gather_delta_memory_by_hand() -> None:
    """tagc-full4 holds tagc-full's feedback plus, per unit of n over W GPUs, the
    gathered weights and the own shard in bf16: 2 (W + 1) ceil(n/W), every unit."""
    s = cl.shape("124m")
    full, full4 = TAGCConfig.preset("tagc-full"), TAGCConfig.preset("tagc-full4")
    model = s.layout(full4.layers, full4.min_numel)
    w = 16
    held = sum(2 * (w + 1) * math.ceil(u.numel / w) for u in model.units)
    a = cl.Assumptions()
    got = cl.memory_per_gpu(s, model, False, 2, 8, 80.0, 1024, a, full4).feedback
    assert got == cl.memory_per_gpu(s, model, False, 2, 8, 80.0, 1024, a, full).feedback + held
    assert held > 2 * s.params  # the unsharded model, not a shard of it


def test_cells_follow_the_presets_as_loaded(capsys: pytest.CaptureFixture) -> None:
    """The feedback column is tagc.memory's figure for the shipped preset (whatever it
    holds now), and TAGC's HSDP route holds nothing at one node (no replicas)."""
    hw = cl.Hardware(8, 80.0, 25.0, 2400.0)
    cs = cl.cells(["124m"], hw, [1, 4], 1024, ["tagc-balanced"], cl.Assumptions())
    cfg = TAGCConfig.preset("tagc-balanced")
    model = cl.shape("124m").layout(cfg.layers, cfg.min_numel)
    for c in cs:
        hsdp = c.layout == "HSDP"
        if c.config == cl.PLAIN or (hsdp and c.nodes == 1):
            assert c.mem.feedback == 0
            continue
        world = 8 if hsdp else 8 * c.nodes
        assert c.mem.feedback == sum(
            cl.feedback_bytes(cfg, u.numel, world, c.nodes if hsdp else 1)
            for u in model.units if u.compressed)
    assert cl.compression_of(cfg).ef21 == bool(cfg.ef21)
    # the codec term times the residual's decode and re-code as the preset keeps it
    assert cl.compression_of(cfg).residual_code == cfg.residual_code == "int4"


def test_model_shapes_have_the_published_sizes() -> None:
    # GPT-2 small (tied head), Llama-2-7B and -70B as their Hugging Face configs count
    assert cl.shape("124m").params == 124_439_808
    assert cl.shape("7b").params == 6_738_415_616
    assert cl.shape("70b").params == 68_976_648_192
    for key in cl.MODEL_SHAPES:  # the layout holds every parameter, once
        s = cl.shape(key)
        assert s.layout("all", 65536).params == s.params
    # GPT-2's 34 d per token and block (Korthikanti et al.) without the s^2 terms
    assert cl.shape("124m").act_bytes_per_token_layer() == 34 * 768
    assert cl.activation_bytes(cl.shape("124m"), 100, "none") > \
        cl.activation_bytes(cl.shape("124m"), 100, "full")


@pytest.mark.parametrize("argv, msg", [
    (["--nic-gbit", "-25"], "--nic-gbit must be > 0"),
    (["--intra-gbit", "-1"], "intra_gbit must be a positive number"),
    (["--gpu-mem-gb", "0"], "gpu_mem_gb must be a positive number"),
    (["--models", "124m,13b"], "unknown model '13b'; known: 124m, 1.3b, 7b, 70b"),
    (["--presets", "tagc-nope"], "tagc-nope"),
    (["--nodes", "0,2"], "--nodes must be > 0"),
    (["--mfu", "1.5"], "mfu"),
    (["--tokens-per-gpu", "0"], "tokens per GPU"),
])
def test_bad_input_is_refused(argv: list, msg: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--cluster", "--models", "124m", "--nodes", "1", *argv])
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err
