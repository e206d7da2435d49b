"""Two ranks on one GPU: the hook's reduce-scatter with a real peer (issue 57 item 3).

NCCL refuses two ranks on one device (the last check shows its message), so the two
processes join a gloo group and hand it CUDA tensors.  The hook sees CUDA tensors on gloo
(``tagc.comm.Comm.staged``) and sends each exchange's messages as one all-to-all, which
gloo stages through pinned host memory on its own thread, after the codec stream's work
and before its later work; the finite vote is gloo's CUDA all-reduce.

The reduce-scatter: per preset (``tagc-balanced``, ``tagc-full``) and path (the unit
path and the general one, ``UnitReducer.UNIT_PATH``), each process builds the reducers of three units on the
device and, as the reference, the same reducers on the CPU (the C codec, the CPU path),
and hands both the same gradients for four steps, the third with an Inf in one of rank
1's.  Checked: every output and the residual codes after every step are the CPU's bit for
bit; at the Inf step the device's outputs are not finite and its residual codes are left
as they were (the CPU takes its plain path there, whose values differ by design); on a
GPU, no call synchronises the host (``torch.cuda.set_sync_debug_mode("error")`` around
the device calls after the first step).  The parameter gathers: ``tagc-full``'s int8 and
``tagc-full4``'s int4 weight changes, one unit of three odd-sized parameters, the gather
comm on the device and on the CPU fed the same shards for three steps: every output bit
for bit.  HSDP's all-reduce between the two processes as replicas (``tagc-balanced``,
the two-phase and the all-gather forms): the same, through the hook's ``hook``.

``--device emu`` (the dry run, no GPU): the reducers' CUDA branch on CPU tensors with the
kernels' own code emulated (``tagc_bench.cuda_emu``), the real gloo peer and the staged
exchange included.  Usage::

    python3 -m tagc_bench.two_ranks --json two.json                # GPU
    python3 -m tagc_bench.two_ranks --device emu --emu-lib LIB     # CPU, emulated kernels
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch
import torch.distributed as dist

import tagc_hook as tagc
from tagc.device import CodecStreams
from tagc.gather import GatherComm, GatherSwitch
from tagc.hsdp import GatherReducer, TwoPhaseReducer
from tagc.reducer import UnitReducer
from tagc.selection import UnitSpec
from tagc.stats import UnitStats
from tagc.train.launch import run_dist
from tagc_bench import cuda_emu
from tagc_bench.cuda_hook import unit_reducers

WORLD = 2
STEPS, INF_STEP = 4, 2
SHARDS = (64 * 20, 64 * 37, 64 * 3)  # per unit: values per shard (whole int4 blocks)
PRESETS = ("balanced", "full")


def gradient(unit: int, step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s flat gradient of ``unit`` at ``step`` (the same in both runs)."""
    g = torch.Generator().manual_seed(10_000 * unit + 100 * step + rank)
    x = torch.randn(WORLD * SHARDS[unit], generator=g) * (1 + step)
    if step == INF_STEP and rank == 1:
        x[5] = float("inf")
    return x


def reducers(cfg: tagc.TAGCConfig, device: torch.device, rank: int,
             unit_path: bool) -> List[UnitReducer]:
    """Each unit's reducer of this rank on the WORLD group, the unit path forced on or off."""
    return unit_reducers(cfg, [WORLD * s for s in SHARDS], device, WORLD,
                         group=dist.group.WORLD, rank=rank, unit_path=unit_path)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


def worker(rank: int, world: int, kind: str, lib: Optional[str]) -> List[Dict[str, Any]]:
    """One process: every case (JSON-ready rows)."""
    cuda = kind == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # both ranks share device 0
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    ops = None if cuda else cuda_emu.EmuOps(lib)

    @contextlib.contextmanager
    def on_device(step: int) -> Iterator[None]:
        if not cuda:
            with cuda_emu.emulated_cuda(ops):
                yield
        elif step == 0:  # the first call allocates and creates state
            yield
        else:
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)

    rows = []
    for preset in PRESETS:
        for unit_path in (True, False):
            cfg = tagc.TAGCConfig.preset(preset)
            dev_r = reducers(cfg, device, rank, unit_path)
            cpu_r = reducers(cfg, torch.device("cpu"), rank, unit_path)
            bad: List[str] = []
            for step in range(STEPS):
                for i, (d, c) in enumerate(zip(dev_r, cpu_r)):
                    g = gradient(i, step, rank)
                    ref = torch.empty(SHARDS[i])
                    c.reduce(g.clone(), ref)
                    before = None if d.residual is None else d.residual.detach().cpu().clone()
                    out = torch.empty(SHARDS[i], device=device)
                    with on_device(step):
                        d.reduce(g.to(device), out)
                    if cuda:
                        torch.cuda.synchronize()
                    where = f"step {step} unit {i}"
                    if step == INF_STEP:
                        if torch.isfinite(out.cpu()).all():
                            bad.append(f"{where}: a rank's Inf did not reach the output")
                        if before is not None and not torch.equal(d.residual.cpu(), before):
                            bad.append(f"{where}: the poisoned call changed the residual")
                        continue
                    if not torch.equal(_bits(out), _bits(ref)):
                        bad.append(f"{where}: output differs from the CPU path "
                                   f"(max |diff| {float((out.cpu() - ref).abs().max()):.3g})")
                    if not torch.equal(d.residual.detach().cpu(), c.residual):
                        bad.append(f"{where}: residual codes differ from the CPU path")
            taken = [r.unit_call for r in dev_r]
            ops_used = sorted({op for r in dev_r for op in r.stats.collectives})
            if "all_to_all_single" not in ops_used or "isend" in ops_used:
                bad.append(f"the messages did not go as one staged all-to-all: {ops_used}")
            rows.append({"preset": preset, "path": "unit" if unit_path else "general",
                         "unit_path_taken": taken, "collectives": ops_used, "failures": bad})
    rows += gathers(rank, device, on_device, cuda)
    rows += hsdp(rank, device, on_device, cuda)
    return rows


HSDP_SHARD = 64 * 30 + 5  # the hook's input: this rank's shard of a unit (odd)


def hsdp(rank: int, device: torch.device, on_device: Any, cuda: bool
         ) -> List[Dict[str, Any]]:
    """HSDP's all-reduce between two replicas (one shard each), ``tagc-balanced``, both
    forms (two-phase and all-gather): the hook on the device and on the CPU, the same
    shards for three steps; every output bit for bit."""
    rows = []
    cfg = tagc.TAGCConfig.preset("balanced")
    for cls in (TwoPhaseReducer, GatherReducer):
        flat = HSDP_SHARD if cls is GatherReducer else WORLD * -(-HSDP_SHARD // WORLD)
        pair = []
        for dev in (device, torch.device("cpu")):
            r = cls(cfg, UnitSpec("u", 0, HSDP_SHARD, flat, HSDP_SHARD, dev), dist.group.WORLD,
                    rank, WORLD, CodecStreams(), HSDP_SHARD)
            r.divide = float(WORLD)
            pair.append(r)
        bad = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            t = torch.randn(HSDP_SHARD, generator=g) * (1 + step)
            ref = t.clone()
            pair[1].hook(ref)
            out = t.to(device)
            with on_device(step):
                pair[0].hook(out)
            if cuda:
                torch.cuda.synchronize()
            if not torch.equal(_bits(out), _bits(ref)):
                bad.append(f"hsdp step {step}: output differs from the CPU path "
                           f"(max |diff| {float((out.cpu() - ref).abs().max()):.3g})")
        rows.append({"preset": "balanced", "path": f"HSDP {cls.FORM}", "unit_path_taken": [],
                     "collectives": sorted(pair[0].stats.collectives), "failures": bad})
    return rows


# one unit's parameter segments (values of each parameter in a rank's shard), odd sizes
SEGMENTS = (64 * 9 + 3, 7, 64 * 4)


def gathers(rank: int, device: torch.device, on_device: Any, cuda: bool
            ) -> List[Dict[str, Any]]:
    """``tagc-full``'s and ``tagc-full4``'s parameter all-gathers with the real peer: the
    gather comm on the device and on the CPU, the same shards for three steps (the
    masters moving a little each step); every output bit for bit."""
    rows = []
    for preset in ("full", "full4"):
        cfg = tagc.TAGCConfig.preset(preset)
        comms = [GatherComm("u", cfg, list(SEGMENTS), dist.group.WORLD, True, UnitStats(),
                            GatherSwitch()) for _ in range(2)]
        n, bad = sum(SEGMENTS), []
        g = torch.Generator().manual_seed(7 + rank)
        shard = torch.randn(n, generator=g)
        for step in range(3):
            shard += 1e-3 * torch.randn(n, generator=g)
            ref = torch.empty(WORLD * n)
            comms[1](ref, shard.clone(), dist.group.WORLD)
            out = torch.empty(WORLD * n, device=device)
            with on_device(step):
                comms[0](out, shard.to(device), dist.group.WORLD)
            if cuda:
                torch.cuda.synchronize()
            if not torch.equal(_bits(out), _bits(ref)):
                bad.append(f"gather step {step}: output differs from the CPU path "
                           f"(max |diff| {float((out.cpu() - ref).abs().max()):.3g})")
        st = comms[0].stats.as_dict()
        if st["gather_quantized_calls"] < 2:
            bad.append(f"the gathers were not quantized: {st['gather_quantized_calls']} of 3")
        rows.append({"preset": preset, "path": "gather" + (" delta" if cfg.gather_delta
                                                           else ""),
                     "unit_path_taken": [], "collectives": [], "failures": bad})
    return rows


def nccl_probe(rank: int, world: int) -> str:
    """What NCCL says to two ranks on one device (both on cuda:0)."""
    torch.cuda.set_device(0)
    try:
        group = dist.new_group(backend="nccl")
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t, group=group)
        torch.cuda.synchronize()
        return f"no error: the all-reduce gave {float(t)}"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "emu"))
    ap.add_argument("--emu-lib", default=None,
                    help="emu: the emulated kernels (default: build them in a temp folder)")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("two_ranks: no CUDA GPU here (use --device emu)", file=sys.stderr)
        return 2
    # the workers by their importable name (run as -m, this module is __main__ here)
    from tagc_bench import two_ranks as this

    with tempfile.TemporaryDirectory() as tmp:
        lib = args.emu_lib
        if args.device == "emu" and lib is None:
            lib = str(cuda_emu.build(tmp))
        per_rank = run_dist(this.worker, WORLD, args.device, lib, timeout=args.timeout)
    res: Dict[str, Any] = {"device": torch.cuda.get_device_name(0) if args.device == "cuda"
                           else "CPU (the CUDA branch with emulated kernels)",
                           "ranks": WORLD, "steps": STEPS, "inf_step": INF_STEP,
                           "shards": list(SHARDS), "cases": []}
    for rows in zip(*per_rank):
        res["cases"].append({"preset": rows[0]["preset"], "path": rows[0]["path"],
                             "unit_path_taken": rows[0]["unit_path_taken"],
                             "collectives": rows[0]["collectives"],
                             "failures": [f"rank {r}: {f}" for r, row in enumerate(rows)
                                          for f in row["failures"]]})
    if args.device == "cuda":
        try:
            res["nccl"] = run_dist(this.nccl_probe, WORLD, timeout=60)[0]
        except AssertionError as exc:  # a hang or a crash: what run_dist saw
            res["nccl"] = f"probe failed: {str(exc)[:300]}"
    ok = all(not c["failures"] for c in res["cases"])
    res["ok"] = ok
    for c in res["cases"]:
        print(f"{c['preset']:9s} {c['path']:15s} units on the unit path "
              f"{sum(c['unit_path_taken'])}/{len(c['unit_path_taken'])}: "
              + ("bit-equal to the CPU path" if not c["failures"] else
                 "; ".join(c["failures"][:3])))
    if "nccl" in res:
        print(f"NCCL, two ranks on one device: {res['nccl']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
