"""scripts/bench/quality_suite.py: the arithmetic of its table, its methods, its reuse
rule, its launches (the installed package, no checkout path), and one tiny end-to-end
run of the cheapest task; compare_quality.py's tables and preset names."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from script_helpers import load_script
from tagc import presets
from tagc_bench import teacher_student as ts
from tagc.train import runs

qs = load_script("quality_suite")


def _run(task: str, seed: int, method: str, final: float) -> qs.Run:
    return qs.Run(task, seed, method, final, 16.0 if method == "plain" else 1.0,
                  None if method == "plain" else 0.5, [(0, 5.0), (10, final)], 1.0,
                  {"commit": "c", "tree": "t", "dirty": ""})


def test_changes_are_per_seed_against_the_same_tasks_plain() -> None:
    runs = [_run("a", 0, "plain", 2.0), _run("a", 0, "tagc-lean", 2.02),
            _run("a", 1, "plain", 4.0), _run("a", 1, "tagc-lean", 3.96),
            _run("b", 0, "plain", 1.0), _run("b", 0, "tagc-lean", 1.5)]
    cells = qs.summarize(runs)
    a = cells[("a", "tagc-lean")]
    # +1% and -1%: the mean of the per-seed changes, not the change of the means
    assert a["pct"] == pytest.approx(0.0) and a["lo"] == pytest.approx(-1.0)
    assert a["hi"] == pytest.approx(1.0) and a["seeds"] == 2
    assert a["loss"] == pytest.approx(2.99)
    # two seeds, +1 and -1: sd sqrt(2), t(1 df) 12.706, n 2: half-width 12.706
    assert a["ci"] == pytest.approx(12.706)
    assert cells[("b", "tagc-lean")]["ci"] is None
    assert cells[("b", "tagc-lean")]["pct"] == pytest.approx(50.0)
    assert cells[("a", "plain")]["pct"] == 0.0 and cells[("a", "plain")]["cbits"] is None


def test_a_run_without_its_plain_baseline_is_refused() -> None:
    with pytest.raises(ValueError, match="no plain FSDP run"):
        qs.summarize([_run("a", 0, "plain", 2.0), _run("a", 1, "tagc-lean", 2.0)])


def test_goals_and_feedback_check_in_the_doc(tmp_path: Path) -> None:
    runs = [_run("a", 0, "plain", 2.0), _run("a", 0, "tagc-lean", 2.05),
            _run("a", 0, "ternary-ef21", 2.05), _run("a", 0, "ternary-nofb", 2.03),
            _run("a", 0, "tagc-balanced", 2.01), _run("a", 0, "int4-nofb", 2.01)]
    text = qs.write_doc(runs, {"a": 60.0}, tmp_path / "s.md", "cmd", ((1.0,), (2.0,)), 1.0)
    rows = {ln.split(" |")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ")}
    # +2.5% misses the +2% goal; lean has no feedback to earn anything with
    assert "+2.50% (a) | NOT met | - | no feedback" in rows["tagc-lean"]
    # 1.0 point above no feedback misses the 0.5 margin; it has no goal of its own
    assert "+2.50% (a) | - | +1.00 points (a) | NO" in rows["ternary-ef21"]
    assert "+0.50% (a) | met | +0.00 points (a) | yes" in rows["tagc-balanced"]
    assert "int4-res" not in rows  # not run: no row
    assert "Scale" not in text
    text = qs.write_doc(runs, {"a": 60.0}, tmp_path / "s.md", "cmd", ((1.0,), (2.0,)), 0.1)
    assert "Scale 0.1" in text


def test_methods_follow_the_preset_files() -> None:
    lean = yaml.safe_load(presets.resolve("tagc-lean").read_text())
    assert qs.method_config("tagc-lean") == lean
    nofb = qs.method_config("ternary-nofb")
    assert nofb["quant_format"] == lean["quant_format"] and nofb["error_feedback"] is False
    assert nofb["ef21"] is False and "ef21_damping" not in nofb
    assert qs.method_config("int4-res")["error_feedback"] is True
    ef21 = qs.method_config("ternary-ef21")
    assert ef21["error_feedback"] is True and ef21["ef21"] is True
    assert ef21["quant_format"] == lean["quant_format"] and "ef21_damping" not in ef21
    assert qs.method_config("plain") is None
    with pytest.raises(SystemExit):
        qs.method_config("nope")


def test_reuse_needs_the_same_code_and_configs(tmp_path: Path) -> None:
    code = {"commit": "c1", "tree": "t1", "dirty": ""}
    meta = runs.run_meta(["x"], {"tagc": {"mode": "quant"}}, code)
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "suite_run.json").write_text(json.dumps(meta))
    assert runs.reusable(tmp_path, meta, "summary.json")
    # another commit of the same code trees (e.g. a docs change) is the same code
    assert runs.reusable(tmp_path, runs.run_meta(["x"], meta["configs"], {**code, "commit": "c2"}),
                        "summary.json")
    for other in (runs.run_meta(["x"], meta["configs"], {**code, "tree": "t2"}),
                  runs.run_meta(["x"], meta["configs"], {**code, "dirty": "d"}),
                  runs.run_meta(["x"], {"tagc": {"mode": "sparse"}}, code)):
        assert not runs.reusable(tmp_path, other, "summary.json")
    (tmp_path / "summary.json").unlink()
    assert not runs.reusable(tmp_path, meta, "summary.json")  # unfinished


def test_code_id_sees_uncommitted_changes() -> None:
    c = runs.code_id()
    assert set(c) == {"commit", "tree", "dirty"} and len(c["tree"]) == 12


def test_tiny_end_to_end(tmp_path: Path) -> None:
    """The regression task at 2 steps, plain vs lean: every seed's runs and the doc."""
    args = SimpleNamespace(out_dir=str(tmp_path), scale=0.02, nproc=2, reuse=False, seeds=[],
                           report_only=False)
    runs, wall = qs.run_suite(["regression-b256"], ["tagc-lean"], args)
    assert {(r.seed, r.method) for r in runs} == {(s, m) for s in (0, 1, 2)
                                                  for m in ("plain", "tagc-lean")}
    lean = [r for r in runs if r.method == "tagc-lean"]
    assert all(0 < r.bits < 2 for r in lean)  # ternary: under 1 bit per parameter at N=2
    text = qs.write_doc(runs, wall, tmp_path / "s.md", "cmd", ((0.0,), (0.0,)), 0.02)
    assert "| regression-b256 |" in text
    assert wall["regression-b256"] == pytest.approx(sum(r.seconds for r in runs))
    assert all(r.seconds > 0 for r in runs)
    # reused, nothing runs again and every run keeps the time it recorded
    again, wall2 = qs.run_suite(["regression-b256"], ["tagc-lean"],
                                SimpleNamespace(**{**vars(args), "reuse": True}))
    assert [(r.seed, r.method, r.final, r.seconds) for r in again] == \
        [(r.seed, r.method, r.final, r.seconds) for r in runs]
    assert wall2 == wall
    # --seeds replaces the task's own seeds (one of them, reused: no launch)
    other, _ = qs.run_suite(["regression-b256"], ["tagc-lean"],
                            SimpleNamespace(**{**vars(args), "seeds": [1], "reuse": True}))
    assert [(r.seed, r.method, r.final) for r in other] == \
        [(r.seed, r.method, r.final) for r in runs if r.seed == 1]
    # --report-only trains nothing: the finished runs as they are, a missing one refused
    report, _ = qs.run_suite(["regression-b256"], ["tagc-lean"],
                             SimpleNamespace(**{**vars(args), "report_only": True}))
    assert [(r.seed, r.method, r.final) for r in report] == \
        [(r.seed, r.method, r.final) for r in runs]
    with pytest.raises(SystemExit, match="report-only"):
        qs.run_suite(["regression-b256"], ["tagc-lean"],
                     SimpleNamespace(**{**vars(args), "report_only": True,
                                        "out_dir": str(tmp_path / "none")}))


def test_bad_seeds_are_refused() -> None:
    with pytest.raises(SystemExit):
        qs.main(["--seeds=1,x", "--tasks=regression"])


def test_teacher_student_refuses_bad_sizes_and_does_not_wait_for_dead_ranks() -> None:
    """Bad sizes are refused before spawning; ranks that die before rank 0 hands over
    its results end the launch with an error instead of a wait with no end."""
    with pytest.raises(SystemExit):
        ts.parse_args(["plain", "--steps=0"])
    args = ts.parse_args(["plain", "--steps=1"])
    args.threads = 0  # torch.set_num_threads(0) raises in both ranks
    with pytest.raises(SystemExit, match="a rank failed"):
        ts.launch(args)


def test_compare_quality_names_the_code_of_its_runs(tmp_path):
    """compare_quality.py's tables name the code the runs recorded (not HEAD), say
    MIXED when cells ran different code, and give plain FSDP's bits for its N."""
    cq = load_script("compare_quality")

    def cell(loss, world, commit, dirty=""):
        return {"final_val_loss": loss, "compressed_bits_per_param": 2.0, "world_size": world,
                "n_params": 10, "steps_this_run": 1, "gather_bytes_sent": 0,
                "_code": {"commit": commit, "tree": "t", "dirty": dirty}}

    assert cq.code_note([cell(1, 2, "c1"), cell(1, 2, "c1")]) == "commit c1"
    assert cq.code_note([cell(1, 2, "c1", "d9")]) == "commit c1 + uncommitted changes d9"
    mixed = cq.code_note([cell(1, 2, "c1"), cell(1, 2, "c2")])
    assert mixed.startswith("MIXED CODE") and "c1" in mixed and "c2" in mixed
    res = {300: {"baseline": cell(2.0, 4, "c1"), "quant-int4": cell(2.02, 4, "c2")}}
    text = cq.write_grid(res, tmp_path / "g.md", "cmd")
    assert "MIXED CODE" in text
    base_row = next(ln for ln in text.splitlines() if ln.startswith("| baseline"))
    assert "| 24.00 |" in base_row  # 32 (N-1)/N at N = 4, not N = 2's 16
    assert "+1.00%" in text


def test_runs_launch_the_package_not_a_checkout_path(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every language-model run the suite launches names a module of the installed package
    (tagc.train, tagc.train.hf) and shipped presets, so the tools work from an installed
    wheel; the regression task, checkout code (scripts/bench/tagc_bench), starts through
    its script, by absolute path, from any folder."""
    seen = []

    def fake_execute(cmd, folder, meta):
        seen.append(cmd)
        raise RuntimeError("not run")

    monkeypatch.setattr(qs, "execute", fake_execute)
    args = SimpleNamespace(out_dir=str(tmp_path), scale=0.01, nproc=2, reuse=False, seeds=[],
                           report_only=False)
    code = {"commit": "c", "tree": "t", "dirty": ""}
    for task in ("gpt2", "llama"):
        with pytest.raises(RuntimeError):
            qs.run_lm(task, qs.TASKS[task], 1, "tagc-balanced", args, code)
    with pytest.raises(RuntimeError):
        qs.run_regression("regression", qs.TASKS["regression"], 0, ["plain"], args, code)
    gpt2, llama, regression = (" ".join(c) for c in seen)
    assert "-m tagc.train " in gpt2 and str(presets.resolve("train-tiny")) in gpt2
    assert "-m tagc.train.hf " in llama
    script = qs.ROOT / "scripts" / "research" / "teacher_student.py"
    assert seen[2][1] == str(script) and Path(seen[2][1]).is_absolute() and script.is_file()
    assert all("scripts" not in part for c in seen[:2] for part in c)


def test_teacher_student_variants_take_preset_names() -> None:
    """A variant's base is a shipped preset by name (with or without tagc-), a YAML
    path or an alias; the aliases state their feedback knobs."""
    lean = yaml.safe_load(presets.resolve("tagc-lean").read_text())
    assert ts.parse_variant("tagc-lean") == lean == ts.parse_variant("lean")
    assert ts.parse_variant(str(presets.resolve("tagc-lean"))) == lean
    assert ts.parse_variant("lean,guard_ratio=8")["guard_ratio"] == 8
    assert ts.parse_variant("ternary-res")["ef21"] is False
    with pytest.raises(ValueError, match="not plain, an alias"):
        ts.parse_variant("nope")


def test_compare_quality_takes_preset_names(tmp_path: Path) -> None:
    """--presets and grid methods take shipped names; a grid cell states its feedback."""
    cq = load_script("compare_quality")
    assert cq._preset_path("tagc-balanced") == cq._preset_path("balanced") == \
        presets.resolve("tagc-balanced").resolve()
    with pytest.raises(SystemExit, match="not a grid method"):
        cq._preset_path("nope")
    cell = yaml.safe_load(cq._cell_config(tmp_path, "quant-int4", None).read_text())
    assert cell["ef21"] is False and cell["error_feedback"] is True
    assert cell["layers"] == "non_attention" and cell["quant_format"] == "int4"
    assert yaml.safe_load(cq._cell_config(tmp_path, "quant-int4-ef21", None)
                          .read_text())["ef21"] is True
