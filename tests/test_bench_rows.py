"""The step benchmark's rows and columns of issue 42 (scripts/bench/bench_step.py,
bench_report.py, tagc/cost/rows.py): the new configurations and the GPT-2 124M plan
parse, the report's exposed communication, peak RSS, bytes at the call and the
worker thread's column, and the
counter of bytes at the call on a 2-rank gloo run of a tiny GPT-2 against the hand
count.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from script_helpers import load_script, script_path

from tagc.cost.rows import ROWS, baseline
from tagc.cost.shapes import BENCH_MODELS

bench_step = load_script("bench_step")
bench_report = load_script("bench_report")

ROOT = Path(__file__).resolve().parent.parent
# issue 42's rows, and issue 56's tagc-full4
PLAN_124M = ["fsdp", "fsdp-bf16", "fsdp-noreshard", "balanced", "full", "full-bf16", "full-int4g",
             "full-noreshard", "full4"]


def _parsed(monkeypatch: Any, argv: list) -> Any:
    """bench_step.main's arguments, the driver not run."""
    seen = {}
    monkeypatch.setattr(bench_step, "_driver", lambda args: seen.setdefault("args", args) and 0)
    bench_step.main(argv)
    return seen["args"]


def test_gpt2_124m_plan_and_rows_parse(monkeypatch: Any) -> None:
    args = _parsed(monkeypatch, ["--model", "gpt2-124m", "--fsdp", "2", "--strategies",
                                 "FULL_SHARD", "--rate", "200mbit", "1gbit"])
    assert args.configs == PLAN_124M and args.rate == ["200mbit", "1gbit"]
    sh = args.shape_obj
    assert (sh.n_layer, sh.n_embd, sh.vocab_size, sh.block_size, sh.batch) == (12, 768, 50257, 256, 1)
    plan = BENCH_MODELS["gpt2-124m"]
    assert (args.warmup, args.steps, args.repeats, args.unshaped_repeats) == \
        (plan.warmup, plan.steps, plan.repeats, plan.unshaped_repeats)
    # the default model keeps its plan and rows; the shape options still apply
    args = _parsed(monkeypatch, ["--configs", "tagc-full-int4g", "fsdp-noreshard", "--fsdp", "2",
                                 "--n-layer", "3"])
    assert args.configs == ["full-int4g", "fsdp-noreshard"] and args.shape_obj.n_layer == 3
    assert args.repeats == BENCH_MODELS["bench"].repeats and args.warmup == 1


@pytest.mark.parametrize("argv, msg", [
    (["--configs", "full-noreshard", "--fsdp", "1"], "reshard_after_forward"),
    (["--configs", "fsdp", "--rate", "none"], "--no-unshaped"),
])
def test_refused_rows_and_rates(argv: list, msg: str, capsys: Any) -> None:
    with pytest.raises(SystemExit):
        bench_step.main(argv)
    assert msg in capsys.readouterr().err


def test_rows_and_their_baselines() -> None:
    assert ROWS["full-int4g"].fields == {"gather": "int4"} and ROWS["full-int4g"].preset == "tagc-full"
    assert not ROWS["full-noreshard"].reshard and ROWS["full-bf16"].bf16
    assert [baseline(r) for r in ("full-noreshard", "full-bf16", "full-int4g", "balanced")] == \
        ["fsdp-noreshard", "fsdp-bf16", "fsdp", "fsdp"]
    # every preset a row names is shipped
    from tagc import presets

    assert all(presets.resolve(r.preset).is_file() for r in ROWS.values() if r.preset)


def test_rate_folders() -> None:
    out = Path("x")
    assert bench_step._rate_dirs(out, ["200mbit"]) == {"200mbit": out}
    assert bench_step._rate_dirs(out, ["200mbit", "1gbit"]) == {"200mbit": out / "200mbit",
                                                                "1gbit": out / "1gbit"}


def _trial(config: str, steps: list, call: float, rss: list) -> dict:
    return {"rep": 0, "strategy": "FULL_SHARD", "config": config, "step_s": steps,
            "veth_tx_per_step_per_host": 2 * call, "codec_s_per_step_per_rank": 0.0,
            "comm_s_per_step_per_rank": 1.0, "call_tx_per_step_per_rank": call,
            "peak_rss_per_rank": rss, "stats_delta_per_step": {}}


def test_report_columns_exposed_rss_and_bytes_at_the_call() -> None:
    shaped = {"trials": [_trial("fsdp", [10.0, 12.0], 8e6, [1e9, 2e9]),
                         _trial("fsdp-noreshard", [8.0], 6e6, [3e9, 1e9]),
                         _trial("full-noreshard", [2.0], 1e6, [3.5e9, 3e9])], "world": 2}
    unshaped = {"trials": [_trial("fsdp", [5.0], 8e6, [1e9, 1e9]),
                           _trial("full-noreshard", [1.5], 1e6, [1e9, 1e9])]}
    rep = {"args": {"configs": ["fsdp", "fsdp-noreshard", "full-noreshard"],
                    "strategies": ["FULL_SHARD"], "nodes": 2, "rate": "200mbit", "delay": "0",
                    "fsdp": 2, "repeats": 1, "steps": 2, "warmup": 1, "unshaped_repeats": 1},
           "shape": {"n_layer": 1, "n_head": 1, "n_embd": 8, "vocab_size": 16, "block_size": 4,
                     "batch": 1}, "shaped": shaped, "unshaped": unshaped}
    s = bench_report.summarize(rep)["FULL_SHARD"]
    assert s["fsdp"]["link_wait_s"] == pytest.approx(6.0)            # 11 - 5
    assert s["full-noreshard"]["link_wait_s"] == pytest.approx(0.5)
    assert s["fsdp-noreshard"]["link_wait_s"] is None                 # not run unshaped
    assert s["full-noreshard"]["speedup_vs_fsdp"] == pytest.approx(4.0)   # vs fsdp-noreshard
    assert s["fsdp"]["peak_rss"] == 2e9 and s["fsdp"]["call_tx"] == 8e6
    md = bench_report.render_markdown(rep, bench_report.summarize(rep))
    assert "| full-noreshard | 2.000 |" in md and "3500.00 MB | 1.500 | 0.500 |" in md


def test_time_split_keeps_the_workers_exchanges_apart() -> None:
    """Collectives and codec calls on TAGC's worker thread (``fsdp_overlap``) run beside
    the compute: they go to their own column, not into the model thread's split (whose
    `in collectives` holds its own calls and its waits for the worker)."""
    import threading

    comm, codec = bench_step._CommTimer(), bench_step._CodecTimer()
    timed = codec._wrap(lambda: None)
    comm.record("all_gather_single", 1.0, 1.5)
    timed()
    worker = threading.Thread(target=lambda: (comm.record("isend", 2.0, 4.0), timed()))
    worker.start()
    worker.join()
    assert comm.seconds == 0.5 and comm.worker_seconds == 2.0
    assert [e[0] for e in comm.events] == ["all_gather_single"]
    assert codec.calls == 2 and codec.worker_seconds > 0 and codec.seconds > 0
    keys = ("worker_codec_s_per_step_per_rank", "worker_comm_s_per_step_per_rank")
    assert bench_report._sum_means([{keys[0]: 0.5, keys[1]: 2.0}], keys) == 2.5
    assert bench_report._sum_means([{keys[0]: 0.0, keys[1]: 0.0}], keys) is None  # no worker
    assert bench_report._sum_means([{}], keys) is None                            # older run


def test_call_byte_rules() -> None:
    """The rules of bench_step's counter on hand-made arguments (w = 4 ranks, rank 1)."""
    import torch

    rules, t = bench_step._CALL_BYTES, torch.zeros(8)            # 32 bytes
    assert rules["all_gather_into_tensor"]({"input_tensor": t}, 4, 1) == 3 * 32
    assert rules["reduce_scatter_tensor"]({"input": t}, 4, 1) == 24
    assert rules["all_reduce"]({"tensor": t}, 4, 1) == 48
    splits = {"input": torch.zeros(8, 2), "input_split_sizes": [1, 3, 2, 2]}   # 64 bytes
    assert rules["all_to_all_single"](splits, 4, 1) == 64 - 3 * 8
    assert rules["all_to_all_single"]({"input": t, "input_split_sizes": None}, 4, 1) == 24
    assert rules["isend"]({"tensor": t}, 4, 1) == 32 and rules["irecv"]({"tensor": t}, 4, 1) == 0


@pytest.mark.dist
def test_bytes_at_the_call_on_two_gloo_ranks(tmp_path: Path) -> None:
    """The worker on 2 gloo ranks (no emulated link) and a tiny GPT-2 whose every dim 0 is
    even (no FSDP2 padding): per rank and step plain FSDP sends 2 gathers x P/2 + the
    reduce-scatter's P/2 elements = 6P bytes in fp32, 3P in bf16, 4P gathering once;
    a TAGC row's count is its own stats' wire bytes plus its gathers."""
    shape = {"n_layer": 1, "n_head": 2, "n_embd": 64, "vocab_size": 128, "block_size": 16,
             "batch": 1}
    e, v, b = shape["n_embd"], shape["vocab_size"], shape["block_size"]
    # wte, wpe; ln_1, ln_2, ln_f (weight + bias); c_attn, attn c_proj, c_fc, mlp c_proj
    params = v * e + b * e + 3 * 2 * e + (e * 3 * e + 3 * e) + (e * e + e) + \
        (e * 4 * e + 4 * e) + (4 * e * e + e)
    result = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script_path("bench_step")), "--worker", "--fsdp", "2", "--strategies", "FULL_SHARD",
           "--configs", "fsdp", "fsdp-bf16", "fsdp-noreshard", "full-int4g",
           "--override", "min_numel=1024", "--shape", json.dumps(shape), "--result", str(result),
           "--repeats", "1", "--steps", "2", "--warmup", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    trials = {t["config"]: t for t in json.loads(result.read_text())["trials"]}
    call = {c: t["call_tx_per_step_per_rank"] for c, t in trials.items()}
    assert call["fsdp"] == 6 * params and call["fsdp-bf16"] == 3 * params
    assert call["fsdp-noreshard"] == 4 * params
    full = trials["full-int4g"]
    assert call["full-int4g"] == full["stats_delta_per_step"]["total"]["wire_bytes"] + \
        full["gather_tx_per_step_per_host"]
    assert all(len(t["peak_rss_per_rank"]) == 2 and min(t["peak_rss_per_rank"]) > 0
               for t in trials.values())
