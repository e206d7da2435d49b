"""GPT-2 124M with TAGC on one GPU in minutes: two ranks simulated in one process.

No quality figure existed above 25M parameters (issue 57 item 4); one H200 computes a
124M step in about 30 ms, so two simulated ranks train about 1000 steps a preset in a
minute.  Every step, each simulated rank computes the loss and gradient of its own batch
(the draw ``TokenData`` makes for (seed, step, rank)), and every unit's gradient goes the
way the hook sends it at two ranks:

* FSDP2's reduce-scatter layout (``tagc_bench.rows.UnitRows``: row r = chunk r of every
  parameter), the units ``tagc.shard_model`` would make (``gpu_step.unit_params``);
* a compressed unit (the preset's selection): the hook's unit path itself,
  ``_tagc.quant_unit_encode`` of each rank's rows with that rank's residual codes, then
  ``_tagc.quant_unit_decode`` of what each owner receives, divided by 2 (the calls the
  hook makes for ``tagc-balanced`` and ``tagc-full`` at N = 2, bit for bit:
  tests/test_unit_path.py); an uncompressed unit and ``plain``: the exact mean;
* ``tagc-full``'s gathers: before each step every unit's weights are coded as the two
  owners' int8 messages (``_tagc.wq_encode`` of each row, a segment per parameter, the
  preset's block) and both ranks compute with the decoded weights, the forward and the
  backward alike; the masters and AdamW never see them, and validation uses the masters
  (as ``train_gpt2.py`` inside ``state.exact_gathers()``).

Then gradient clipping at 1.0 and AdamW (``tagc.train.optim``: decay on matrices,
betas 0.9 / 0.95), a linear warm-up and a cosine to a tenth.  What it leaves out: the
network (nothing is sent), FSDP itself, and the vote's all-reduce (both simulated ranks'
finiteness is known here).

The tie (``--tie_steps``, 20 by default): each preset's first steps again as two real
processes (:func:`real_worker`: ``tagc.shard_model``, ``tagc.register``, the same model,
batches, optimizer, clipping and schedule; on a GPU both share it over gloo), whose mean
train losses must be the simulation's within ``--tie_tol`` (1e-3).  On the CPU (tiny
shape, 30 steps) they agreed within 3e-5 for all three presets.

Usage::

    python3 -m tagc_bench.gpu_quality --json q.json --report q.md   # GPU: GPT-2 124M
    python3 -m tagc_bench.gpu_quality --device cpu --shape tiny --steps 6 --context 64 \\
        --batch 2 --eval_every 3                                    # a check of the code
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch
import torch.distributed as dist
import torch.nn as nn

import tagc_hook as tagc
from tagc.codec import _tagc
from tagc.device import nonfinite_vote
from tagc.reducer import UNIT_COUNTS
from tagc.selection import UnitSpec
from tagc.train import data as token_data
from tagc.train.model import GPT, GPTConfig
from tagc.train.launch import run_dist
from tagc.train.optim import configure_optimizer, decayed_parameter_names
from tagc_bench.cuda_ops import require_device
from tagc_bench.gpu_step import SHAPES, unit_params
from tagc_bench.rows import UnitRows

WORLD = 2
PRESETS = ("plain", "balanced", "full")


def selected(model: nn.Module, cfg: tagc.TAGCConfig, params: List[nn.Parameter]) -> bool:
    """Whether the hook compresses a unit of these parameters (``UnitSpec.compressed`` of
    what ``cfg``'s selection picks)."""
    where = {id(p): (mn, m, pn) for mn, m in model.named_modules()
             for pn, p in m.named_parameters(recurse=False)}
    sel = sum(p.numel() for p in params if tagc.select_parameter(cfg, *where[id(p)], p))
    n = sum(p.numel() for p in params)
    return UnitSpec("unit", 0, n, n, sel, torch.device("cpu")).compressed


class SimRanks:
    """The hook's exchange of every unit over two simulated ranks, with its state.

    Args:
        model: the model (one copy: the ranks' weights are the same).
        preset: ``plain`` or a shipped preset.
        device: where the model lives.
    """

    def __init__(self, model: nn.Module, preset: str, device: torch.device) -> None:
        self.cfg = None if preset == "plain" else tagc.TAGCConfig.preset(preset)
        self.device, self.cuda = device, device.type == "cuda"
        units = unit_params(model, self.cfg or tagc.TAGCConfig.preset("balanced"))
        self.units = [UnitRows(name, ps, WORLD) for name, ps in units]
        self.compressed = [self.cfg is not None and selected(model, self.cfg, u.params)
                           for u in self.units]
        self.codes: List[List[torch.Tensor]] = []  # per unit, per rank: residual codes
        for u, c in zip(self.units, self.compressed):
            if c and u.row % self.cfg.quant_block:
                raise ValueError(f"unit {u.name}: a row of {u.row} values is not a whole "
                                 f"number of blocks of {self.cfg.quant_block} (the hook "
                                 "would take its general path, which this does not run)")
            self.codes.append([self._zero_codes(u) for _ in range(WORLD)] if c else [])
        self.kw: Dict[str, Any] = {}
        if self.cuda:
            self.counts = torch.zeros(len(UNIT_COUNTS), dtype=torch.int64, device=device)
            self.flags = torch.zeros(2, dtype=torch.int32, device=device)

    def _zero_codes(self, u: UnitRows) -> torch.Tensor:
        n, fmt, block = WORLD * u.row, self.cfg.residual_code, self.cfg.quant_block
        codes = torch.empty(_tagc.quant_bytes(n, fmt, block), dtype=torch.uint8,
                            device=self.device)
        _tagc.quant_encode(codes, None, torch.zeros(n, device=self.device), fmt, block,
                           **self._kw())
        return codes

    def _kw(self) -> Dict[str, Any]:
        return {"stream": torch.cuda.current_stream(self.device).cuda_stream} \
            if self.cuda else {}

    def reduce(self, grads: List[List[torch.Tensor]]) -> None:
        """Each parameter's ``.grad`` = what the owners' reduced shards give.

        Args:
            grads: per rank, every parameter's gradient in the units' order.
        """
        at = 0
        vote = None
        if self.cuda:  # the hook's vote over both ranks: 0, or NaN when one is not finite
            vote = nonfinite_vote(torch.stack([g.float().sum() for gr in grads for g in gr]))
        for i, u in enumerate(self.units):
            k = len(u.params)
            rows = [u.rows([g.float() for g in gr[at:at + k]]) for gr in grads]
            at += k
            for p, g in zip(u.params, u.unrows(self.reduce_unit(i, rows, vote))):
                p.grad = g.to(p.dtype)

    def reduce_unit(self, i: int, rows: List[torch.Tensor],
                    vote: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Unit i's reduced rows: row r is what owner r's reduce-scatter gives.

        Args:
            i: the unit.
            rows: per rank, its (2, S) reduce-scatter input.
            vote: CUDA: the ranks' summed finite vote (float32: 0 when every rank's
                gradient is finite, else NaN), which the unit encode reads.
        Returns:
            (2, S) fp32.
        """
        if not self.compressed[i]:
            return (rows[0] + rows[1]) / WORLD
        u, codes, cfg, kw = self.units[i], self.codes[i], self.cfg, self._kw()
        fmt, rfmt, block = cfg.quant_format, cfg.residual_code, cfg.quant_block
        nb = _tagc.quant_bytes(u.row, fmt, block)
        bufs = [torch.empty(WORLD, nb, dtype=torch.uint8, device=self.device)
                for _ in range(WORLD)]
        for r in range(WORLD):
            extra = {} if not self.cuda else {"counts": self.counts, "flags": self.flags,
                                              "vote": vote}
            _tagc.quant_unit_encode(bufs[r], codes[r], rows[r].reshape(-1), WORLD, r, fmt,
                                    rfmt, block, cfg.residual_factor, **extra, **kw)
        out = torch.empty(WORLD, u.row, device=self.device)
        for r in range(WORLD):
            recv = torch.stack([bufs[j][r] for j in range(WORLD)])  # row j: rank j's message
            _tagc.quant_unit_decode(out[r], recv, rows[r][r], WORLD, r, fmt, block,
                                    float(WORLD), **kw)
        return out

    def gathered(self) -> List[Tuple[nn.Parameter, torch.Tensor]]:
        """tagc-full: (parameter, the weights both ranks compute with) of every unit,
        the int8 gather messages of its two owners decoded; none without gathers."""
        if self.cfg is None or self.cfg.gather == "none":
            return []
        out = []
        fmt, block, kw = self.cfg.gather, self.cfg.gather_block, self._kw()
        for u in self.units:
            rows = u.rows([p.detach() for p in u.params])
            segs = u.segments
            dec = torch.empty_like(rows)
            for r in range(WORLD):
                msg = torch.empty(_tagc.wq_bytes(segs, fmt, block), dtype=torch.uint8,
                                  device=self.device)
                dsegs = torch.tensor(segs, dtype=torch.int64, device=self.device) \
                    if self.cuda else segs
                _tagc.wq_encode(msg, rows[r].contiguous(), dsegs, fmt, block, **kw)
                _tagc.wq_decode(dec[r], msg, dsegs, fmt, block, **kw)
            out += list(zip(u.params, u.unrows(dec)))
        return out


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then a cosine to lr / 10 at ``steps`` (train-gpt2.yaml's shape)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    r = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr / 10 + 0.5 * (1 + math.cos(math.pi * r)) * (lr - lr / 10)


def train(preset: str, args: argparse.Namespace, data: token_data.TokenData,
          vocab: int, device: torch.device, log: Callable[[str], None] = print
          ) -> Dict[str, Any]:
    """One preset's run.

    Returns:
        its curve (train loss per step, the ranks' mean), its validation losses and
        timing (JSON-ready).
    """
    cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    gcfg = GPTConfig(block_size=args.context, **{**SHAPES[args.shape], "vocab_size": vocab})
    model = GPT(gcfg).to(device)
    opt = configure_optimizer(model, decayed_parameter_names(model), 0.1, args.lr, (0.9, 0.95))
    sim = SimRanks(model, preset, device)
    params = [p for u in sim.units for p in u.params]

    def amp() -> torch.autocast:  # bf16 compute on the GPU; the CPU check runs fp32
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def evaluate() -> float:
        model.eval()
        with torch.no_grad(), amp():
            losses = [float(model(*(t.to(device) for t in data.get_batch(
                "val", args.batch, args.context, (args.seed, 1, k, 0))))[1])
                for k in range(args.eval_batches)]
        model.train()
        return sum(losses) / len(losses)

    curve, val, times = [], [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        swapped = sim.gathered()
        masters = [(p, p.data) for p, _ in swapped]
        for p, w in swapped:
            p.data = w.to(p.dtype)
        grads, losses = [], []
        for r in range(WORLD):
            x, y = (t.to(device) for t in data.get_batch("train", args.batch, args.context,
                                                         (args.seed, 0, step, 0, r)))
            with amp():
                loss = model(x, y)[1]
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad for p in params])
            for p in params:
                p.grad = None
        for p, m in masters:
            p.data = m
        sim.reduce(grads)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(float(sum(losses)) / WORLD)  # a host read per step: the clock's too
        times.append(time.perf_counter() - t0)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val.append((step + 1, evaluate()))
            log(f"{preset}: step {step + 1}: train {curve[-1]:.4f}, val {val[-1][1]:.4f}, "
                f"{1e3 * statistics.median(times):.1f} ms a step")
    return {"preset": preset, "curve": curve, "val": val, "final_val": val[-1][1],
            "ms_per_step": 1e3 * statistics.median(times),
            "compressed_units": sum(sim.compressed), "units": len(sim.units),
            "params": sum(p.numel() for p in model.parameters())}


def real_worker(rank: int, world: int, preset: str, opts: Dict[str, Any], kind: str
                ) -> List[float]:
    """Rank ``rank`` of two real processes: :func:`train`'s model, data, optimizer and
    schedule on FSDP2 (``tagc.shard_model``) with the hook registered (``plain``: FSDP2
    alone), the first ``tie_steps`` steps; the ranks' mean train loss of each step.  On
    a GPU both processes share device 0 over gloo (``Comm.staged``)."""
    args = argparse.Namespace(**opts)
    cuda = kind == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    data = token_data.TokenData(args.meta)
    torch.manual_seed(args.seed)
    gcfg = GPTConfig(block_size=args.context,
                     **{**SHAPES[args.shape], "vocab_size": args.vocab})
    model = GPT(gcfg).to(device)
    decayed = decayed_parameter_names(model)
    cfg = tagc.TAGCConfig.preset("balanced" if preset == "plain" else preset)
    model = tagc.shard_model(model, cfg)
    if preset != "plain":
        tagc.register(model, cfg)
    opt = configure_optimizer(model, decayed, 0.1, args.lr, (0.9, 0.95))
    curve = []
    for step in range(args.tie_steps):
        x, y = (t.to(device) for t in data.get_batch("train", args.batch, args.context,
                                                     (args.seed, 0, step, 0, rank)))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        curve.append(float(total) / world)
    return curve


def tie(runs: List[Dict[str, Any]], args: argparse.Namespace, meta: Dict[str, Any],
        vocab: int, kind: str) -> Dict[str, Any]:
    """Each preset's first ``args.tie_steps`` train losses from two real processes
    (:func:`real_worker`) against the simulation's.

    Returns:
        per preset: the largest |difference| and whether it is within ``args.tie_tol``,
        or the error that stopped the real run.
    """
    from tagc_bench import gpu_quality as this  # the workers by their importable name

    opts = {**vars(args), "meta": meta, "vocab": vocab}
    out = {}
    for run in runs:
        try:
            real = run_dist(this.real_worker, WORLD, run["preset"], opts, kind,
                            timeout=args.tie_timeout)[0]
        except AssertionError as exc:  # a worker's error or a hang, as run_dist reports it
            out[run["preset"]] = {"error": str(exc).strip().splitlines()[-1][:300]}
            continue
        diff = max(abs(a - b) for a, b in zip(real, run["curve"]))
        out[run["preset"]] = {"steps": len(real), "max_abs_diff": diff,
                              "ok": diff <= args.tie_tol, "real": real}
    return out


def report(res: Dict[str, Any]) -> str:
    """The markdown report of :func:`main`'s results."""
    runs = res["runs"]
    plain = next((r["final_val"] for r in runs if r["preset"] == "plain"), None)
    lines = [f"# Quality at {res['params'] / 1e6:.1f}M parameters, two ranks simulated",
             "", f"{res['device']}; GPT ({res['shape']}, context {res['context']}, vocab "
             f"{res['vocab']}), {res['batch']} sequences a rank a step, {res['steps']} steps, "
             f"lr {res['lr']} (warm-up {res['warmup']}), seed {res['seed']}; validation on "
             f"{res['eval_batches']} batches.  Made by `scripts/gpu_quality.sh` "
             "(tagc_bench/gpu_quality.py says what is simulated).", "",
             "| preset | final val loss | vs plain | ms a step | compressed units |",
             "|---|---:|---:|---:|---:|"]
    for r in runs:
        vs = "" if plain is None or r["preset"] == "plain" else \
            f"{100 * (r['final_val'] - plain) / plain:+.2f}%"
        lines.append(f"| {r['preset']} | {r['final_val']:.4f} | {vs} | {r['ms_per_step']:.1f} "
                     f"| {r['compressed_units']} of {r['units']} |")
    lines += ["", "Validation loss along the run:", "",
              "| step | " + " | ".join(r["preset"] for r in runs) + " |",
              "|---:|" + "---:|" * len(runs)]
    for i, (step, _) in enumerate(runs[0]["val"]):
        lines.append(f"| {step} | " + " | ".join(f"{r['val'][i][1]:.4f}" for r in runs) + " |")
    if res.get("tie"):
        lines += ["", f"The simulation against two real processes (FSDP2 and the hook, the "
                  f"same model, data and optimizer), the first {res['tie_steps']} train losses "
                  f"(tolerance {res['tie_tol']}):", "", "| preset | max abs difference | |",
                  "|---|---:|---|"]
        for preset, t in res["tie"].items():
            lines.append(f"| {preset} | " + (f"{t['max_abs_diff']:.2e} | "
                                            f"{'within' if t['ok'] else '**outside**'} |"
                                            if "error" not in t else
                                            f"- | **the real run failed**: {t['error']} |"))
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="gpt2-124m", choices=sorted(SHAPES))
    ap.add_argument("--presets", nargs="+", default=list(PRESETS),
                    help="plain and shipped presets (the first is the reference)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8, help="sequences a rank a step")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval_every", type=int, default=100)
    ap.add_argument("--eval_batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--tie_steps", type=int, default=20,
                    help="steps of two real processes per preset to compare (0: none)")
    ap.add_argument("--tie_tol", type=float, default=1e-3)
    ap.add_argument("--tie_timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None, help="markdown report")
    args = ap.parse_args(argv)
    require_device("gpu_quality", args.device)
    device = torch.device(args.device)
    meta = token_data.prepare(token_data.get_source("stdlib", 5.0),
                              token_data.get_tokenizer("auto"), Path("data_cache"))
    data = token_data.TokenData(meta)
    # GPT-2's vocabulary (124M parameters) whatever the tokenizer (byte-level offline)
    vocab = SHAPES[args.shape]["vocab_size"]
    if meta["vocab_size"] > vocab:
        raise SystemExit(f"gpu_quality: the tokenizer's {meta['vocab_size']} tokens exceed "
                         f"the model's {vocab}")
    runs = [train(p, args, data, vocab, device) for p in args.presets]
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else "cpu (not a measurement)", "shape": args.shape, "context": args.context,
           "vocab": vocab, "tokenizer_vocab": meta["vocab_size"], "batch": args.batch,
           "steps": args.steps, "lr": args.lr, "warmup": args.warmup, "seed": args.seed,
           "eval_batches": args.eval_batches, "params": runs[0]["params"], "runs": runs,
           "tie_steps": min(args.tie_steps, args.steps), "tie_tol": args.tie_tol}
    if args.tie_steps:
        args.tie_steps = res["tie_steps"]
        res["tie"] = tie(runs, args, meta, vocab, device.type)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.report:
        Path(args.report).write_text(report(res))
    print(report(res))
    return 0 if all(t.get("ok") for t in res.get("tie", {}).values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
