"""Tests for the benchmark's bookkeeping (no network, no torch.distributed): medians,
speed-ups, target verdicts, stats deltas and the chart, on hand-made results."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from script_helpers import load_script

bench_report = load_script("bench_report")
bench_step = load_script("bench_step")


def _trial(strategy: str, config: str, steps: list[float], rep: int = 0, wire: float | None = None,
           tx: float = 1e6) -> dict:
    delta = {} if wire is None else {"total": {"wire_bytes": wire, "default_wire_bytes": 4 * wire}}
    return {"rep": rep, "strategy": strategy, "config": config, "step_s": steps,
            "veth_tx_per_step_per_host": tx, "veth_rx_per_step_per_host": tx,
            "codec_s_per_step_per_rank": 0.1, "comm_s_per_step_per_rank": 0.5 * steps[0],
            "stats_delta_per_step": delta}


def _report() -> dict:
    shaped = {"trials": [
        _trial("FULL_SHARD", "fsdp", [4.0, 4.2, 3.8], 0), _trial("FULL_SHARD", "fsdp", [4.0], 1),
        _trial("FULL_SHARD", "dense", [3.0, 3.0], 0, wire=8.0),
        _trial("FULL_SHARD", "exact", [2.0, 2.0], 0, wire=1.0),
        _trial("FULL_SHARD", "sparse", [4.0, 4.0], 0, wire=0.5),
    ], "torch": "x"}
    unshaped = {"trials": [_trial("FULL_SHARD", "fsdp", [1.0, 1.0])]}
    return {"args": {"configs": ["fsdp", "dense", "exact", "sparse"], "strategies": ["FULL_SHARD"],
                     "nodes": 2, "rate": "200mbit", "delay": "0", "fsdp": 1, "repeats": 2, "steps": 3,
                     "warmup": 1, "unshaped_repeats": 1},
            "shape": {"n_layer": 1, "n_head": 1, "n_embd": 8, "vocab_size": 16, "block_size": 4,
                      "batch": 1},
            "shaped": shaped, "unshaped": unshaped, "codec_table": "| codec |\n", "wall_s": 1.0}


def test_summary_medians_ratios_and_bytes():
    s = bench_report.summarize(_report())["FULL_SHARD"]
    assert s["fsdp"]["median_s"] == pytest.approx(4.0)          # median of 4.0, 4.2, 3.8, 4.0
    assert s["fsdp"]["spread"] == (pytest.approx(4.0), pytest.approx(4.0))
    assert s["exact"]["speedup_vs_fsdp"] == pytest.approx(2.0)
    assert s["exact"]["speedup_vs_dense"] == pytest.approx(1.5)
    assert s["dense"]["stats_bytes"] == pytest.approx(8.0)
    assert s["dense"]["stats_default_bytes"] == pytest.approx(32.0)
    assert s["fsdp"]["stats_bytes"] is None
    assert s["fsdp"]["median_unshaped_s"] == pytest.approx(1.0)
    assert s["exact"]["median_unshaped_s"] is None


def test_markdown_verdicts_and_share():
    rep = _report()
    md = bench_report.render_markdown(rep, bench_report.summarize(rep))
    assert "| FULL_SHARD | exact | 1.30x | 2.00x | met |" in md
    # sparse is as slow as fsdp: 1.00x against 1.35x
    assert "| FULL_SHARD | sparse | 1.35x | 1.00x | missed by 0.35x (26%) |" in md
    assert "| SHARD_GRAD_OP | exact | 1.60x | - | not measured |" in md
    assert "75.0%" in md          # 1 - 1.0 / 4.0
    assert "| codec |" in md


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rep = _report()
    bench_report.plot(bench_report.summarize(rep), tmp_path / "c.png", "t")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_delta_is_per_key_and_nested():
    before = {"total": {"wire_bytes": 10, "calls": 1, "name": "a"}, "flag": True}
    after = {"total": {"wire_bytes": 40, "calls": 4, "name": "a"}, "flag": True}
    d = bench_step._scale(bench_step._numeric_delta(after, before), 1 / 3)
    assert d == {"total": {"wire_bytes": pytest.approx(10.0), "calls": pytest.approx(1.0)}}


def test_model_shape_validates():
    with pytest.raises(ValueError):
        bench_step.ModelShape(n_embd=100, n_head=3)
    with pytest.raises(ValueError):
        bench_step.ModelShape(batch=0)


bench_time = load_script("bench_time_to_loss")


def test_time_to_loss_interpolates_between_evaluations() -> None:
    curve = [(0.0, 5.0), (10.0, 3.0), (20.0, 2.0), (30.0, 1.5)]
    assert bench_time.time_to(curve, 2.5) == pytest.approx(15.0)
    assert bench_time.time_to(curve, 2.0) == pytest.approx(20.0)
    assert bench_time.time_to(curve, 1.0) is None
    assert bench_time.time_to(curve, 9.0) == 0.0
    assert bench_time.time_to([], 1.0) is None
    # a flat stretch at the target: its first point; a rise and fall: the first crossing
    assert bench_time.time_to([(0.0, 3.0), (5.0, 2.0), (9.0, 2.0)], 2.0) == pytest.approx(5.0)
    assert bench_time.time_to([(0.0, 3.0), (4.0, 1.0), (8.0, 3.0), (12.0, 1.0)], 2.0) == \
        pytest.approx(2.0)


def _ttl_results() -> dict:
    """Synthetic curves: the 300-step run of ``p`` ends just above plain FSDP's final
    loss, its equal-time run passes it between two evaluations (the README's case)."""
    return {"steps": 300, "loadavg": (1.0, 1.0, 1.0), "loadavg_end": (1.5, 1.0, 1.0),
            "link": "192 Mbit/s",
            "baseline": {"curve": [(0.0, 5.0), (100.0, 2.5), (258.7, 2.1339)]},
            "presets": {
                "p": {"curve": [(0.0, 5.0), (40.0, 2.5), (80.3, 2.1369)],
                      "equal_time_steps": 966,
                      "equal_time_curve": [(0.0, 5.0), (73.6, 2.1400), (80.2, 2.0991),
                                           (257.2, 1.6357)]},
                "q": {"curve": [(0.0, 5.0), (60.0, 2.2), (120.0, 2.0)],
                      "equal_time_steps": 500,
                      "equal_time_curve": [(0.0, 5.0), (250.0, 1.9)]},
                "never": {"curve": [(0.0, 5.0), (50.0, 2.2)], "equal_time_steps": 400,
                          "equal_time_curve": [(0.0, 5.0), (250.0, 2.15)]}}}


def test_time_to_loss_takes_the_earlier_run_and_interpolates() -> None:
    """The time to plain FSDP's final loss comes from the evaluation points of either of
    a preset's runs, the earlier one, linear between the two points around it."""
    reach = bench_time.time_to_baseline(_ttl_results())
    target = 2.1339
    # equal-time run: between (73.6, 2.1400) and (80.2, 2.0991)
    t = 73.6 + (80.2 - 73.6) * (2.1400 - target) / (2.1400 - 2.0991)
    assert reach["p"] == (pytest.approx(t), "equal time")
    assert 258.7 / t == pytest.approx(3.469, abs=1e-3)
    # the same-steps run reaches it first: between (60, 2.2) and (120, 2.0)
    assert reach["q"] == (pytest.approx(60 + 60 * (2.2 - target) / 0.2), "same steps")
    assert reach["never"] == (None, "")


def test_time_to_loss_report(tmp_path: Path) -> None:
    text = bench_time.report(_ttl_results(), tmp_path / "t.md", "cmd")
    rows = {ln.split(" |")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ")}
    t = 73.6 + (80.2 - 73.6) * (2.1400 - 2.1339) / (2.1400 - 2.0991)
    assert f"| {t:.1f} s (equal time run) | {258.7 / t:.2f}x |" in rows["p"]
    assert "| 966 (257.2 s) | 1.6357 | -23.35% |" in rows["p"]
    assert "| not reached | — |" in rows["never"]
    assert (tmp_path / "t.md").read_text() == text
    bench_time.plot(_ttl_results(), tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0


def test_time_to_loss_report_only_recomputes_a_run_folder(tmp_path: Path,
                                                          capsys: Any) -> None:
    """--report-only DIR rewrites the table and the plot from DIR/results.json (an
    earlier run's, without the fields newer runs record), training nothing."""
    import json

    (tmp_path / "results.json").write_text(json.dumps(_ttl_results()))
    assert bench_time.main(["--report-only", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(equal time run) | 3.47x" in out and "command not recorded" in out
    assert (tmp_path / "time_to_loss.md").is_file() and (tmp_path / "time_to_loss.png").is_file()
    with pytest.raises(SystemExit):
        bench_time.main(["--report-only", str(tmp_path / "nowhere")])


def test_hsdp_report_targets() -> None:
    """--hsdp: TAGC HSDP against native HSDP (speed-up, slow-link bytes) and against
    TAGC FULL_SHARD, with verdicts that can miss."""
    trials = [_trial("HSDP", "fsdp", [8.0], tx=30e6), _trial("HSDP", "sparse", [1.6], tx=1e6),
              _trial("HSDP", "balanced", [4.0], tx=4e6), _trial("FULL_SHARD", "fsdp", [9.0]),
              _trial("FULL_SHARD", "sparse", [2.0]), _trial("FULL_SHARD", "balanced", [3.0])]
    rep = _report()
    rep["shaped"], rep["unshaped"] = {"trials": trials}, None
    rep["args"].update(configs=["fsdp", "sparse", "balanced"], strategies=["FULL_SHARD", "HSDP"],
                       per_node=2, fsdp=2)
    md = bench_report.render_markdown(rep, bench_report.summarize(rep))
    assert "| sparse | 5.00x | met | 30.00x | met | 1.25x | met |" in md
    assert "| balanced | 2.00x | missed by 2.00x (50%) | 7.50x | missed by 7.50x (50%) | " \
           "0.75x | missed |" in md
    assert "2 ranks each" in md


@pytest.mark.parametrize("argv, msg", [
    (["--hsdp", "--fsdp", "1"], "FSDP2"),
    (["--hsdp", "--per-node", "0"], "per-node"),
    (["--strategies", "HSDP"], "needs --hsdp"),
    (["--hsdp", "--strategies", "SHARD_GRAD_OP"], "compares FULL_SHARD and HSDP"),
])
def test_bench_step_refuses_bad_layouts(argv: list, msg: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as e:
        bench_step.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_peer_wait_splits_the_wait_for_the_last_rank_off() -> None:
    """Call k of every rank is one collective: a rank that entered before the last one
    waited for it, at most for its own time in the call; sequences that differ cannot
    be matched and give None."""
    pw = bench_step.peer_wait
    ev = [[("all_reduce", 0.0, 1.0), ("wait", 2.0, 2.1)],
          [("all_reduce", 0.4, 1.0), ("wait", 2.5, 2.6)]]
    w = pw(ev)
    assert w == pytest.approx([0.4 + 0.1, 0.0])  # the second call capped at its 0.1 s
    assert pw([[("all_reduce", 0.0, 1.0)], [("wait", 0.0, 1.0)]]) is None
    assert pw([[("all_reduce", 0.0, 1.0)], []]) is None
    assert pw([]) is None
    assert pw([[], []]) == [0.0, 0.0]


def test_report_shows_the_peer_wait_column() -> None:
    rep = _report()
    for t in rep["shaped"]["trials"]:
        t["peer_wait_s_per_step_per_rank"] = 0.25
    rep["shaped"]["trials"][-1]["peer_wait_s_per_step_per_rank"] = None  # unmatched: left out
    summary = bench_report.summarize(rep)
    assert summary["FULL_SHARD"]["fsdp"]["peer_wait_s"] == pytest.approx(0.25)
    assert summary["FULL_SHARD"]["sparse"]["peer_wait_s"] is None
    md = bench_report.render_markdown(rep, summary)
    assert "of it, peer wait s" in md and "| 0.250 |" in md


def test_cpu_columns_and_machine_busy_share() -> None:
    """CPU s/rank is the trials' mean; machine busy = busy CPU-s per step over CPUs x
    mean step; absent fields print '-'."""
    rep = _report()
    for t in rep["shaped"]["trials"]:
        t["cpu_s_per_step_per_rank"] = 0.25
        t["host_busy_cpu_s_per_step"] = 2.0 if t["config"] == "exact" else None
    rep["cpus"] = 2
    s = bench_report.summarize(rep)["FULL_SHARD"]
    assert s["exact"]["cpu_s"] == pytest.approx(0.25)
    assert bench_report._busy_share(s["exact"], 2) == pytest.approx(2.0 / (2 * 2.0))
    assert bench_report._busy_share(s["fsdp"], 2) is None
    assert bench_report._busy_share(s["exact"], None) is None
    md = bench_report.render_markdown(rep, bench_report.summarize(rep))
    row = next(ln for ln in md.splitlines() if ln.startswith("| exact | 2.000"))
    assert "| 0.250 | 50.0% |" in row
    busy = bench_step._host_busy()
    assert busy is None or busy > 0


def test_cpu_bound_and_ceiling() -> None:
    """The step no schedule of the machine beats: ranks x CPU s/rank / CPUs; the ceiling
    is plain FSDP's step over it (the R = 4 run of RESULTS.md: 4 ranks of 0.495 CPU-s on
    2 CPUs bound a step at 0.99 s, 4.410 s / 0.99 s = 4.45x)."""
    rep = _report()
    rep["cpus"] = 2
    rep["shaped"]["world"] = 4
    for t in rep["shaped"]["trials"]:
        t["cpu_s_per_step_per_rank"] = 0.495 if t["config"] == "exact" else 1.013
        if t["config"] == "fsdp":
            t["step_s"] = [4.410]
    s = bench_report.summarize(rep)["FULL_SHARD"]
    assert s["exact"]["cpu_bound_s"] == pytest.approx(0.99)
    assert s["exact"]["ceiling_vs_fsdp"] == pytest.approx(4.410 / 0.99)
    md = bench_report.render_markdown(rep, bench_report.summarize(rep))
    assert "## CPU bound" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| FULL_SHARD | exact | 0.495"))
    assert "| 1.980 | 0.990 |" in row and row.endswith("| 4.45x |")
    # without the CPU figures (an older results.json) the section is left out
    assert "## CPU bound" not in bench_report.render_markdown(_report(),
                                                              bench_report.summarize(_report()))


def test_run_reports_go_to_docs_runs(tmp_path: Path) -> None:
    """The benchmarks' default report folder: docs/runs/<kind>-<UTC date-time> of the
    checkout, which git does not ignore (docs/runs/README.md)."""
    import subprocess

    from tagc_bench.outputs import run_dir

    d = run_dir(tmp_path, "step", 0.0)
    assert d == tmp_path / "docs" / "runs" / "step-19700101-000000"
    root = Path(__file__).resolve().parent.parent
    if (root / ".git").exists():
        r = subprocess.run(["git", "check-ignore", "-q", "docs/runs/step-x/report.md"], cwd=root)
        assert r.returncode == 1, "docs/runs/ is ignored by git: reports could not be committed"


def test_bench_step_takes_preset_names(monkeypatch: Any) -> None:
    """--configs takes a preset's name with or without tagc- (nothing runs here)."""
    seen = {}
    monkeypatch.setattr(bench_step, "_driver", lambda args: seen.setdefault("args", args) and 0)
    bench_step.main(["--configs", "fsdp", "tagc-balanced", "lean", "--profile", "tagc-lean"])
    args = seen["args"]
    assert args.configs == ["fsdp", "balanced", "lean"] and args.profile == ["lean"]
    assert Path(args.config_dir).is_dir() and Path(args.out).parent.name == "runs"
