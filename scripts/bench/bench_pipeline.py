#!/usr/bin/env python3
"""Pipeline step time and boundary bytes on an emulated slow link (issue 40).

Driver (needs root): two emulated hosts (``tagc/train/netem.sh``, one network namespace
each, a veth pair shaped by ``tc``), one pipeline stage per host, launched with
``torchrun`` per namespace; the worker (``--worker``) runs every row round-robin
``--repeats`` times: a fresh GPT-2 cut in two stages (:class:`tagc.train.pipeline.
PipelineRun`, the training code itself: schedule, global clip, AdamW step), random
tokens, ``--warmup`` steps, then ``--steps`` timed steps, reading each host's veth byte
counters (``/sys/class/net/<if>/statistics/tx_bytes``) around them.  Each shaped rate
runs, then the link unshaped: a row's exposed communication is its shaped step minus
its unshaped step, and the uncompressed row's share of its step spent on the link is
``1 - unshaped / shaped``.

``--dp D`` (PP x FSDP): each stage an FSDP2 group of D emulated hosts, one rank each,
2 x D hosts on a bridge with every port shaped: FSDP2's gathers and reduce-scatters
inside a stage cross the slow link as the boundary does, so the rows code both
(``+full``: ``tagc-full`` inside the stages); the plain rows run plain FSDP2 there.
Every rank shares this machine's two cores (the unshaped step says how much).

The benchmark model is chosen so that the uncompressed pipeline is link-bound on this
CPU (issue 40: a boundary carries 4d bytes per token and direction against ~72 L d^2
FLOPs per token of a stage): width 128, one block per stage, context 128, batch 8 in 4
microbatches, the byte-level vocabulary (257 ids, padded to 320).  ``--batch`` sends
more tokens per step: the step's fixed costs (the schedule's Python, the optimizer) stay,
the link's share grows.

Usage:
    sudo python3 scripts/bench/bench_pipeline.py                  # 50 and 20 Mbit/s
    sudo python3 scripts/bench/bench_pipeline.py --rate 20mbit --rows fp32 int8 sub16
    sudo python3 scripts/bench/bench_pipeline.py --batch 32       # 4x the tokens per step

Writes ``docs/runs/pp-<UTC date-time>/`` (``results.json``, ``report.md``), or ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from tagc.train.runs import NETEM, free_port, netem, shown
from tagc_bench.outputs import run_dir

logger = logging.getLogger("bench_pipeline")
ROOT = Path(__file__).resolve().parents[2]

# row -> PipelineConfig fields (the microbatches and schedule of the presets)
ROWS: Dict[str, Dict[str, Any]] = {
    "fp32": {"format": "fp32"},
    "bf16": {"format": "bf16"},
    "int8": {"format": "int8"},
    "int4": {"format": "int4"},
    "int4-g8": {"format": "int4", "grad_format": "int8"},
    "sub32": {"format": "fp32", "subspace_k": 32},
    "sub16": {"format": "fp32", "subspace_k": 16},
    "sub8": {"format": "fp32", "subspace_k": 8},
    "sub16-int8": {"format": "int8", "subspace_k": 16},
    "sub16-bf16": {"format": "bf16", "subspace_k": 16},
    # PP x FSDP (--dp > 1): the boundary's code and TAGC inside the stages
    "int8+full": {"format": "int8", "stage": "tagc-full"},
    "int4+full": {"format": "int4", "stage": "tagc-full"},
}


def model_args(width: int, batch: int = 8) -> List[str]:
    """The benchmark GPT-2's options: ``width`` wide, one block per stage, ``batch``
    sequences per step."""
    return ["--n_layer=2", "--n_head=4", f"--n_embd={width}", "--block_size=128",
            f"--batch_size={batch}"]


class RandomTokens:
    """``TokenData.get_batch``'s interface over uniform random ids (seeded by the key)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def get_batch(self, split: str, batch: int, block: int, key: Any) -> Any:
        import torch
        seed = 1 if split == "val" else 0
        for k in key:  # a fixed mix (Python's hash of a str is salted per process)
            seed = (seed * 1000003 + int(k)) % (2 ** 61 - 1)
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, self.vocab, (batch, block + 1), generator=g)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _tx(ifname: str) -> int:
    p = Path("/sys/class/net") / ifname / "statistics" / "tx_bytes"
    return int(p.read_text()) if p.exists() else -1


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from tagc import teardown
    from tagc.pipeline import PipelineConfig
    from tagc.train.config import parse_config
    from tagc.train.pipeline import PipelineRun

    torch.set_num_threads(1)  # one core per emulated host
    dist.init_process_group("gloo")
    teardown.install()
    rank = dist.get_rank()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    world = dist.get_world_size()
    cfg = parse_config([*model_args(args.width, args.batch), "--pp=2", "--tie_weights=false",
                        "--tokenizer=byte", "--progress=false", "--warmup_iters=0",
                        *(["--fsdp=2", f"--sharding={args.sharding}"] if world > 2 else [])])
    data = RandomTokens(257)
    trials = []
    for rep in range(args.repeats):
        for row in args.rows:
            torch.manual_seed(cfg.seed)
            fields = dict(ROWS[row])
            rcfg = dataclasses.replace(cfg, stage_tagc=fields.pop("stage", None))
            pcfg = PipelineConfig(**fields)
            run = PipelineRun(rcfg, pcfg, 257, rank, world, torch.device("cpu"))
            for it in range(args.warmup):
                run.train_step(data, it, cfg.learning_rate)
            dist.barrier()
            inner0 = run.stage_bytes()
            tx0, t0 = _tx(ifname), time.perf_counter()
            times = []
            for it in range(args.steps):
                s = time.perf_counter()
                run.train_step(data, args.warmup + it, cfg.learning_rate)
                times.append(time.perf_counter() - s)
            dist.barrier()
            wall = time.perf_counter() - t0
            sent = torch.tensor([_tx(ifname) - tx0], dtype=torch.int64)
            dist.all_reduce(sent)  # each host's veth counted what it sent
            inner = run.stage_bytes() - inner0
            dist.all_reduce(inner)  # TAGC's counts inside the stages, every rank
            trials.append({"rep": rep, "row": row, "step_s": statistics.median(times),
                           "mean_step_s": sum(times) / len(times), "wall_s": wall,
                           "veth_bytes_per_step": int(sent.item()) / args.steps,
                           # every dp replica's boundary messages
                           "format_bytes_per_step": run.step_bytes * run.dp,
                           "fp32_bytes_per_step": run.step_bytes_fp32 * run.dp,
                           "stage_bytes_per_step": (inner / args.steps).tolist()})
            del run
    if rank == 0:
        Path(args.result).write_text(json.dumps({"trials": trials,
                                                 "model": model_args(args.width, args.batch),
                                                 "torch": torch.__version__}, indent=1))
    dist.destroy_process_group()
    return 0


def _launch(net: List[str], args: argparse.Namespace, result: Path, repeats: int) -> Dict:
    if result.exists():
        result.unlink()
    cmd = ["bash", str(NETEM), *net, "torchrun", "--port", str(free_port()), "--timeout",
           str(int(args.timeout)), "--", str(Path(__file__).resolve()), "--worker",
           "--dp", str(args.dp), "--sharding", args.sharding,
           "--result", str(result), "--rows", *args.rows, "--repeats", str(repeats),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--width", str(args.width), "--batch", str(args.batch)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TAGC_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, timeout=args.timeout + 60, env=env)
    if r.returncode != 0 or not result.exists():
        raise RuntimeError(f"benchmark workers failed (exit {r.returncode})")
    return json.loads(result.read_text())


def _summary(res: Dict) -> Dict[str, Dict[str, float]]:
    """Per row: the median over repeats of the step, and the bytes."""
    out: Dict[str, Dict[str, float]] = {}
    for row in dict.fromkeys(t["row"] for t in res["trials"]):
        ts = [t for t in res["trials"] if t["row"] == row]
        out[row] = {"step_s": statistics.median(t["step_s"] for t in ts),
                    "veth": statistics.median(t["veth_bytes_per_step"] for t in ts),
                    "format": ts[0]["format_bytes_per_step"],
                    "fp32": ts[0]["fp32_bytes_per_step"],
                    # TAGC inside the stages: [rs sent, plain, gathers sent, plain]
                    "stage": ts[0].get("stage_bytes_per_step", [0.0] * 4)}
    return out


def report(data: Dict) -> str:
    """The markdown report of a run's ``results.json``."""
    un = _summary(data["unshaped"]) if data.get("unshaped") else {}
    dp = data.get("dp", 1)
    hosts = ("2 hosts, one stage each" if dp == 1 else
             f"{2 * dp} hosts: each stage an FSDP2 group of {dp} hosts (PP x FSDP), every "
             "host's port shaped, so FSDP2's traffic inside a stage crosses the link too")
    lines = [f"# Pipeline step on the emulated link ({data['started_utc']} UTC)", "",
             f"Command: `{data['command']}`; load average {data['loadavg_start'][0]:.2f} at "
             f"the start, {data['loadavg_end'][0]:.2f} at the end; {data['cpus']} CPUs. "
             f"Model: `{' '.join(data['unshaped']['model'])}`, 2 stages (one block each), 4 microbatches, 1F1B, "
             f"random byte-level tokens; {hosts}. Step: median over repeats of each trial's "
             "median step. Bytes: every host's veth tx counter per step (TCP/IP headers "
             "included), what the format puts in the boundary messages (payload, every dp "
             "replica's), and with TAGC inside the stages its gathers and reduce-scatters "
             "at the call against plain FSDP2's for the same calls.", ""]
    if un:
        lines.append(f"Unshaped link: {data['link_unshaped']}")
        lines.append("")
    for rate, rep in data["shaped"].items():
        s = _summary(rep["result"])
        base = s.get("fp32")
        lines += [f"## {rate} ({rep['link']})", "",
                  "| row | veth bytes/step | payload bytes/step | fewer than fp32 | step "
                  "(s) | unshaped (s) | shaped / unshaped | speed-up vs fp32 |"
                  + (" FSDP2 inside the stages, bytes/step at the call |" if dp > 1 else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" if dp > 1 else "")]
        for row, v in s.items():
            u = un.get(row, {}).get("step_s", float("nan"))
            st = v["stage"]
            inside = (f" {st[0] + st[2]:.0f} of plain's {st[1] + st[3]:.0f} "
                      f"({(st[0] + st[2]) / (st[1] + st[3]):.3f}) |" if st[1] + st[3] else
                      " plain FSDP2 |")
            lines.append(f"| {row} | {v['veth']:.0f} | {v['format']:.0f} | "
                         f"{v['fp32'] / v['format']:.1f}x | {v['step_s']:.3f} | {u:.3f} | "
                         f"{v['step_s'] / u:.2f} | "
                         f"{base['step_s'] / v['step_s'] if base else float('nan'):.2f}x |"
                         + (inside if dp > 1 else ""))
        if base and "fp32" in un:
            lines += ["", f"fp32's share of its step on the link: "
                      f"{1 - un['fp32']['step_s'] / base['step_s']:.0%} (1 - unshaped / shaped)"]
        lines.append("")
    return "\n".join(lines)


def _driver(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        sys.exit("bench_pipeline.py: needs root to build the emulated network")
    out = Path(args.out) if args.out else run_dir(ROOT, "pp")
    out.mkdir(parents=True, exist_ok=True)
    prefix = f"tagcp{os.getpid() % 1000}"

    def net(rate: str) -> List[str]:
        return ["--prefix", prefix, "-n", str(2 * args.dp), "--rate", rate, "--delay", "0"]

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data: Dict[str, Any] = {"started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                            "loadavg_start": os.getloadavg(), "cpus": os.cpu_count(),
                            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                            "dp": args.dp, "shaped": {}}
    t0 = time.perf_counter()
    try:
        netem(net(args.rate[0]), "up")
        for rate in args.rate:
            netem(net(rate), "rate", rate)
            link = netem(net(rate), "measure", "5", timeout=600).strip()
            logger.info("%s", link)
            data["shaped"][rate] = {"link": link, "result": _launch(
                net(rate), args, out / f"raw_{rate}.json", args.repeats)}
        netem(net("none"), "rate", "none")
        data["link_unshaped"] = netem(net("none"), "measure", "20", timeout=600).strip()
        data["unshaped"] = _launch(net("none"), args, out / "raw_unshaped.json", args.repeats)
    finally:
        netem(net(args.rate[0]), "down", check=False)
    data["loadavg_end"], data["wall_s"] = os.getloadavg(), time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(data, indent=1))
    text = report(data)
    (out / "report.md").write_text(text + "\n")
    print(text)
    print(f"\nwall {data['wall_s']:.0f} s; report: {shown(out / 'report.md')}")
    return 0


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", nargs="+", default=["50mbit", "20mbit"], help="shaped rates")
    p.add_argument("--rows", nargs="+", choices=list(ROWS),
                   help="default: every row without TAGC inside the stages, with --dp > 1 "
                        "fp32, int8, int4, int8+full, int4+full")
    p.add_argument("--width", type=int, default=128, help="the model's width (<= 128)")
    p.add_argument("--batch", type=int, default=8,
                   help="sequences per step, a multiple of the 4 microbatches (default 8)")
    p.add_argument("--dp", type=int, default=1,
                   help="emulated hosts per stage, an FSDP2 group (PP x FSDP; default 1)")
    p.add_argument("--sharding", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP"],
                   help="FSDP2 inside the stages (--dp > 1): SHARD_GRAD_OP gathers a stage "
                        "once a step, FULL_SHARD again for microbatches (default FULL_SHARD)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default="", help="report folder (default docs/runs/pp-<date>)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--report", default="", help="re-render the report of a results.json")
    args = p.parse_args(argv)
    if args.dp < 1:
        p.error(f"--dp must be >= 1, got {args.dp}")
    if args.rows is None:
        args.rows = ([r for r in ROWS if "stage" not in ROWS[r]] if args.dp == 1 else
                     ["fp32", "int8", "int4", "int8+full", "int4+full"])
    if args.dp == 1 and any("stage" in ROWS[r] for r in args.rows):
        p.error("rows with TAGC inside the stages (+full) need --dp 2 or more")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.worker:
        return _worker(args)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    return _driver(args)


if __name__ == "__main__":
    sys.exit(main())
