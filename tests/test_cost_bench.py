"""The cost model on the step benchmark's rows (issue 42; tagc/cost/bench.py and
cost_model.py --predict-bench / --check PREDICTIONS --measured): the bf16 policy,
gathering once and int4 gathers counted by hand, predictions from one unshaped plain
step, the run-time estimate, and the comparison with a (fake) bench_step report.

Fast: small layouts, no processes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tagc import cost as cm
from tagc.cost import bench, cli
from tagc.cost.check import check

pytestmark = pytest.mark.codec  # the model sizes messages by the _tagc codec


# a table as bench_collectives.py writes it: every collective at 10 MB/s, the link 100 Mbit/s
KINDS = ("all_reduce", "all_gather", "all_to_all", "p2p", "p2p_ring")


def link(mbit: float, rate: float) -> dict:
    """A fake bench_collectives.py output of 2 hosts, one rank each."""
    return {"nodes": 2, "per_node": 1, "command": "bench_collectives.py (fake)",
            "link_measured": f"netem.sh: measured {mbit} Mbit/s host1->host0 (10 MiB)",
            "collectives": {"world": {k: [[1e6, rate]] for k in KINDS}}}


def one_unit(numel: int) -> cm.ModelSpec:
    return cm.ModelSpec("one", (cm.Unit("u", ((numel, 1),), True),))


def test_rows_counted_by_hand_at_n2() -> None:
    """P elements in one unit, N = 2: plain fp32 sends 2 gathers of P/2 and a
    reduce-scatter's P/2 (x 4 bytes) = 6P; bf16 3P; gathering once 4P."""
    p, model = 4096, one_unit(4096)
    cl = cm.Cluster(1, 2, 1.0, 1.0)
    call = {r: cm.predict(model, cl, cm.row_config(r)).ideal_bytes_per_rank
            for r in ("fsdp", "fsdp-bf16", "fsdp-noreshard", "full", "full-bf16", "full-int4g",
                      "full-noreshard")}
    assert (call["fsdp"], call["fsdp-bf16"], call["fsdp-noreshard"]) == (6 * p, 3 * p, 4 * p)
    gathers = {r: cm.predict(model, cl, cm.row_config(r)).ideal["gather"] for r in call}
    # int8 codes of the other rank's half, a 4-byte scale per 256: twice, once
    assert gathers["full"] == 2 * (p // 2 + 4 * p // 2 // 256)
    assert gathers["full-noreshard"] == gathers["full"] / 2
    assert gathers["full-int4g"] == 2 * (p // 4 + 4 * p // 2 // 256)
    assert call["full-bf16"] == call["full"]        # codes do not depend on the dtype
    assert cm.row_config("full-int4g").name == "fsdp+full-int4g"
    assert cm.row_config("fsdp-bf16").dtype == "bf16" and not cm.row_config("fsdp-noreshard").reshard
    with pytest.raises(ValueError, match="not modelled"):
        cm.row_config("exact")


def _clusters() -> dict:
    return {"slow": bench.rate_cluster(2, link(100.0, 1e7), "slow"),
            bench.UNSHAPED: bench.rate_cluster(2, link(10000.0, 1e9), "none")}


def test_predictions_from_one_unshaped_step() -> None:
    model = one_unit(1 << 20)
    pred = bench.predict_rows(model, ["fsdp", "full-noreshard"], _clusters(), plain_s=2.0)
    fsdp = pred["rows"]["fsdp"]
    # the unshaped plain row is the measured step by construction; compute = it - comm
    assert fsdp[bench.UNSHAPED]["step_s"] == pytest.approx(2.0)
    assert pred["compute_s"] == pytest.approx(2.0 - pred["unshaped_comm_s"])
    # the gathers 2 x P/2 x 4 bytes, gloo's reduce-scatter an all-reduce of as much, at
    # 10 MB/s, and 4 latency terms of 0.1 ms (the gathers' 2, the all-reduce's 2)
    assert fsdp["slow"]["comm_s"] == pytest.approx(8 * (1 << 20) / 1e7 + 4e-4)
    assert fsdp["slow"]["exposed_s"] == pytest.approx(fsdp["slow"]["step_s"] - 2.0)
    assert fsdp["slow"]["call_mb"] == pytest.approx(6 * (1 << 20) / 1e6)
    assert pred["rows"]["full-noreshard"]["slow"]["step_s"] < fsdp["slow"]["step_s"]
    with pytest.raises(ValueError, match="unshaped"):
        bench.predict_rows(model, ["fsdp"], {"slow": _clusters()["slow"]}, 2.0)
    with pytest.raises(ValueError, match="not longer"):
        bench.predict_rows(model, ["fsdp"], _clusters(), plain_s=1e-6)


def test_run_estimate() -> None:
    pred = {"compute_s": 1.0, "rows": {"fsdp": {"slow": {"step_s": 3.0}, "none": {"step_s": 1.5}}}}
    plan = {"rates": ["slow"], "configs": ["fsdp"], "warmup": 1, "steps": 2, "repeats": 2,
            "unshaped_repeats": 1, "unshaped_configs": ["fsdp"]}
    # 2 x (1 + 3 x 3) + 1 x (1 + 3 x 1.5)
    assert bench.run_estimate_s(pred, plan) == pytest.approx(25.5)
    assert "estimated wall time 0 min (26 s" in bench.estimate_text(pred, plan)
    with pytest.raises(ValueError, match="no prediction of fsdp at fast"):
        bench.run_estimate_s(pred, {**plan, "rates": ["fast"]})


def _results(rate: str, steps: dict, call: dict, unshaped: dict) -> dict:
    """A fake bench_step.py results.json of one rate."""
    def trials(d: dict) -> list:
        return [{"config": c, "step_s": [s], "call_tx_per_step_per_rank": call[c],
                 "veth_tx_per_step_per_host": 1.1 * call[c], "stats_delta_per_step": {}}
                for c, s in d.items()]
    return {"args": {"rate": rate}, "shaped": {"trials": trials(steps)},
            "unshaped": {"trials": trials(unshaped)}}


def test_compare_with_a_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = one_unit(1 << 20)
    pred = bench.predict_rows(model, ["fsdp", "full"], _clusters(), plain_s=2.0)
    p = pred["rows"]
    call = {c: p[c]["slow"]["call_mb"] * 1e6 for c in p}
    # the run: fsdp 10% slower than predicted, full as predicted; unshaped as predicted
    rep = _results("slow", {"fsdp": 1.1 * p["fsdp"]["slow"]["step_s"], "full": p["full"]["slow"]["step_s"]},
                   call, {c: p[c][bench.UNSHAPED]["step_s"] for c in p})
    rows = bench.compare(pred, [rep])
    got = {(r.setup, r.config, r.quantity): r for r in rows}
    assert got[("slow", "fsdp", "step_s")].error == pytest.approx(1 / 1.1 - 1)
    assert got[("slow", "full", "step_s")].error == pytest.approx(0.0)
    assert got[("slow", "fsdp", "call_mb")].exact and got[(bench.UNSHAPED, "full", "call_mb")].exact
    assert got[("slow", "full", "exposed_s")].error == pytest.approx(0.0)
    text = bench.compare_report(rows, 0.2)
    assert "step time within 20%: 4 of 4" in text and "exact (two decimals of MB): 4 of 4" in text
    # the command line: the predictions file against the run's folder
    f = tmp_path / "predictions.json"
    f.write_text(json.dumps({"kind": cli.PREDICTIONS_KIND, **pred}))
    (tmp_path / "run" / "slow").mkdir(parents=True)
    (tmp_path / "run" / "slow" / "results.json").write_text(json.dumps(rep))
    assert cli.main(["--check", str(f), "--measured", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "| fsdp | slow |" in out and "-9.1%" in out
    with pytest.raises(SystemExit):
        cli.main(["--check", str(f)])
    assert "--measured" in capsys.readouterr().err


def test_predict_bench_cli(tmp_path: Path, capsys: pytest.CaptureFixture,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """--predict-bench on the default model's rows, from fake inputs."""
    from dataclasses import asdict, replace

    from tagc.cost.shapes import BENCH_MODELS

    plan = BENCH_MODELS["bench"]
    step = {"args": {"rate": "none", "fsdp": 2}, "shape": asdict(plan.shape),
            "link_shaped": "netem.sh: measured 9000.0 Mbit/s", "loadavg_start": [1.0, 1.0, 1.0],
            "loadavg_end": [1.5, 1.0, 1.0],
            "shaped": {"world": 2, "trials": [{"config": "fsdp", "step_s": [3.0, 3.2]}]}}
    paths = {}
    for name, obj in (("step", step), ("slow", link(200.0, 2e7)), ("none", link(9000.0, 5e8))):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(obj))
    out = tmp_path / "pred"
    # bench's default rows include exact and the 10x presets, which are not modelled
    with pytest.raises(SystemExit):
        cli.main(["--predict-bench", "bench", "--plain-step", str(paths["step"]),
                  "--link", f"200mbit={paths['slow']}", "--link", f"none={paths['none']}",
                  "--out", str(out)])
    assert "not modelled" in capsys.readouterr().err
    rows = ("fsdp", "fsdp-bf16", "full-int4g")
    monkeypatch.setitem(BENCH_MODELS, "bench", replace(plan, configs=rows))
    assert cli.main(["--predict-bench", "bench", "--plain-step", str(paths["step"]),
                     "--link", f"200mbit={paths['slow']}", "--link", f"none={paths['none']}",
                     "--out", str(out)]) == 0
    data = json.loads((out / "predictions.json").read_text())
    assert data["kind"] == cli.PREDICTIONS_KIND and list(data["rows"]) == list(rows)
    assert data["rows"]["fsdp"]["none"]["step_s"] == pytest.approx(3.1)
    assert data["plan"]["rates"] == ["200mbit"] and data["estimate_s"] > 0
    assert "## 200mbit" in (out / "predictions.md").read_text()


def test_runs_file_takes_bench_rows_and_bytes_at_the_call() -> None:
    """A runs-file setup with the benchmark's rows, bytes at the call and a compute time
    from the fast link's own table (fast_collectives)."""
    model = cm.run_model("gpt2-124m-c256")
    fast = bench.rate_cluster(2, link(10000.0, 1e9), "none")
    comm = cm.predict(model, fast, cm.row_config("fsdp"), 0.0).step_s
    noreshard = cm.predict(model, fast, cm.row_config("fsdp-noreshard"), 0.0)
    data = {"links": {"slow": link(200.0, 2e7), "none": link(10000.0, 1e9)},
            "setups": {"s": {"model": "gpt2-124m-c256", "fsdp": 2, "layout": "fsdp", "dtype": "fp32",
                             "ranks_per_node": 1, "nodes": 2, "inter_mbit": 10000.0,
                             "collectives": "none",
                             "compute": {"plain_fast_step_s": comm + 5.0, "fast_mbit": 10000.0,
                                         "fast_collectives": "none"}}},
            "runs": [{"setup": "s", "config": "fsdp", "step_s": comm + 5.0},
                     {"setup": "s", "config": "fsdp-noreshard",
                      "step_s": noreshard.step_s + 5.0,
                      "call_mb": round(noreshard.ideal_bytes_per_rank / 1e6, 2)}]}
    rows = {(r.config, r.quantity): r for r in check(data)}
    assert rows[("fsdp-noreshard", "call_mb")].exact
    # compute = 5 s exactly, because the fast link is timed from its own table
    assert rows[("fsdp-noreshard", "step_s")].error == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("worker", [False, True])
def test_add_a_run_to_the_check_set(tmp_path: Path, capsys: pytest.CaptureFixture,
                                    worker: bool) -> None:
    """--check PREDICTIONS --measured RUN --add-to RUNS: a setup per rate (the unshaped one
    too) whose compute is the predictions' input, rows with the run's numbers, the link
    tables; the runs file's check then predicts the rows as the predictions did, TAGC's
    FSDP2 worker included when the predictions had it."""
    model = cm.run_model("gpt2-124m-c256")
    tables = {}
    for rate, (mbit, bps) in {"slow": (200.0, 2e7), bench.UNSHAPED: (9000.0, 5e8)}.items():
        f = tmp_path / f"collectives-{rate}" / "collectives.json"
        f.parent.mkdir()
        f.write_text(json.dumps(link(mbit, bps)))
        tables[rate] = str(f)
    clusters = {r: bench.rate_cluster(2, link(*v), r)
                for r, v in {"slow": (200.0, 2e7), bench.UNSHAPED: (9000.0, 5e8)}.items()}
    pred = bench.predict_rows(model, ["fsdp", "full-noreshard"], clusters, plain_s=20.0,
                              worker=worker)
    pred.update({"kind": cli.PREDICTIONS_KIND, "bench_model": "gpt2-124m", "layout": "gpt2-124m-c256",
                 "fsdp": 2, "nodes": 2, "worker": worker,
                 "inputs": {"plain_step": {"step_s": 20.0, "report": "step/results.json"},
                            "links": {r: {"table": t, "inter_mbit": bench.measured_mbit(
                                link(*{"slow": (200.0, 2e7)}.get(r, (9000.0, 5e8)))["link_measured"])}
                                      for r, t in tables.items()}}})
    p = pred["rows"]
    call = {c: p[c]["slow"]["call_mb"] * 1e6 for c in p}
    rep = _results("slow", {c: p[c]["slow"]["step_s"] for c in p}, call,
                   {c: p[c][bench.UNSHAPED]["step_s"] for c in p})
    from dataclasses import asdict

    from tagc.cost.shapes import BENCH_MODELS

    rep.update({"shape": asdict(BENCH_MODELS["gpt2-124m"].shape),
                "started_utc": "2026-11-28 10:00:00", "command": "bench_step.py (fake)",
                "link_shaped": "netem.sh: measured 200.0 Mbit/s",
                "link_unshaped": "netem.sh: measured 9000.0 Mbit/s"})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(json.dumps(rep))
    pf = tmp_path / "predictions.json"
    pf.write_text(json.dumps(pred))
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps({"links": {}, "setups": {}, "runs": []}))
    argv = ["--check", str(pf), "--measured", str(tmp_path / "run"), "--add-to", str(runs)]
    assert cli.main(argv) == 0
    assert "added 2 setups, 4 rows and 2 link tables" in capsys.readouterr().out
    data = cm.load_runs(str(runs))
    got = {(r.setup, r.config, r.quantity): r for r in check(data)}
    for rate in ("slow", bench.UNSHAPED):
        for c in p:
            r = got[(f"gpt2-124m-202611281000-{rate}", cm.row_config(c).name, "step_s")]
            assert r.error == pytest.approx(0.0, abs=1e-3), (rate, c, r)
    assert got[("gpt2-124m-202611281000-slow", "fsdp", "call_mb")].exact
    assert data["setups"]["gpt2-124m-202611281000-slow"].get("worker", False) == worker
    with pytest.raises(SystemExit):  # the same run twice
        cli.main(argv)
    assert "setups" in capsys.readouterr().err
    # a later run on the same link tables: the tables kept once, its setups added
    later = {**rep, "started_utc": "2026-11-28 11:00:00"}
    (tmp_path / "run" / "results.json").write_text(json.dumps(later))
    assert cli.main(argv) == 0
    assert "added 2 setups, 4 rows and 0 link tables" in capsys.readouterr().out
    assert "gpt2-124m-202611281100-slow" in cm.load_runs(str(runs))["setups"]
    # a table of the same name with other content is refused
    f = Path(tables["slow"])
    f.write_text(json.dumps(link(100.0, 1e7)))
    (tmp_path / "run" / "results.json").write_text(json.dumps({**rep, "started_utc":
                                                                "2026-11-28 12:00:00"}))
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert "with other content" in capsys.readouterr().err
    with pytest.raises(ValueError, match="the run measured"):  # a run of another model
        bench.compare(pred, [{**rep, "shape": {**rep["shape"], "n_layer": 1}}])
