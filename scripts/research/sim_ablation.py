"""Compressors and AdamW in one process: N simulated ranks, the tiny GPT-2, no FSDP.

The research probe behind docs/DESIGN.md section 8 (quality): it isolates what a gradient
compressor does to AdamW training, in a couple of minutes per 300 steps, and measures
the mechanism against plain (dense) training of the same seed and data:

* the update each compressed layer receives (sum over steps of ||param change||),
* AdamW's second moment at the end (mean sqrt(v)) per compressed layer,
* the cosine between what the optimizer got and the true mean gradient, per step.

It also covers the candidates the hook does not implement (DGC momentum correction,
EF21 on a momentum estimate, one top-k threshold across layers, top-k with low-bit
values).  Everything the hook implements is measured on the real thing (2 processes,
FSDP, the codec) by ``compare_quality.py --grid``; numbers from here are labelled "sim".

    python3 scripts/research/sim_ablation.py dense topk:d=0.0125 quant:fmt=ternary ef21:fmt=ternary

Methods (``name:key=value,...``):
  dense                      plain averaging (always run first: the reference)
  topk:d=D[,vf=F]            top-k per tensor and rank with residual error feedback;
                             values fp32, or vf=bf16/int8/int4 (block-quantized)
  quant:fmt=F                every entry on the codec's format F (sign, ternary, int4,
                             int8; _tagc.quant_encode itself) with residual feedback
  ef21:fmt=F | ef21:d=D      EF21 (Richtarik et al. 2021): compress g - h, h += that,
                             the owner returns the running sum of every rank's h
  ef21m:fmt=F | ef21m:d=D    EF21 on a momentum estimate v = 0.9 v + 0.1 g (EF21-SGDM)
  dgc:d=D                    DGC (Lin et al. 2018): local momentum correction, top-k of
                             the accumulated momentum, factor masking
  gtopk:d=D                  one top-k threshold per rank over all compressed tensors
                             (each layer's density follows its share of the gradient)
Any method takes dense=F: the first F * steps steps uncompressed (a warm-up that
scales with the run length).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import tagc_hook as tagc
from tagc.train import data as token_data
from tagc.train.model import GPT, GPTConfig
from tagc.train.optim import configure_optimizer, decayed_parameter_names

# the scripts' helpers, scripts/bench/tagc_bench, from the folder beside this one
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from tagc_bench.probes import evaluate, lr_at  # noqa: E402 - after the path

FORMAT_BITS = {"fp32": 32.0, "bf16": 16.0, "int8": 8.0, "int4": 4.0}


def parse_method(spec: str) -> Tuple[str, Dict[str, str]]:
    """``name:key=value,...`` -> (name, {key: value})."""
    name, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    known = {"dense", "topk", "quant", "ef21", "ef21m", "dgc", "gtopk"}
    if name not in known:
        raise SystemExit(f"unknown method {name!r}; known: {sorted(known)}")
    return name, opts


def entropy_bits(d: float) -> float:
    """Binary entropy: bits per entry to name which entries are kept at density d."""
    return 0.0 if d <= 0 or d >= 1 else -(d * math.log2(d) + (1 - d) * math.log2(1 - d))


class Compressor:
    """One message per (tensor, rank): returns what the owner decodes, and its bits."""

    def __init__(self, opts: Dict[str, str], block: int = 256) -> None:
        self.d = float(opts.get("d", 1.0))
        self.fmt = opts.get("fmt")
        self.vf = opts.get("vf", "fp32")
        self.block = block
        if self.fmt is None and self.d >= 1.0:
            raise SystemExit("give d=<density> (top-k) or fmt=<quant format>")
        if self.fmt is not None and self.fmt not in tagc.QUANT_FORMATS:
            raise SystemExit(f"fmt must be one of {tagc.QUANT_FORMATS}")
        if self.vf not in FORMAT_BITS:
            raise SystemExit(f"vf must be one of {sorted(FORMAT_BITS)}")

    def __call__(self, v: torch.Tensor) -> Tuple[torch.Tensor, float]:
        if self.fmt is not None:
            import _tagc

            flat = v.reshape(-1).contiguous()
            buf = torch.empty(_tagc.quant_bytes(flat.numel(), self.fmt, self.block),
                              dtype=torch.uint8)
            _tagc.quant_encode(buf, None, flat, self.fmt, self.block)
            out = torch.zeros_like(flat)
            _tagc.quant_decode_add(out, buf, self.fmt, self.block)
            return out.view_as(v), 8.0 * buf.numel()
        k = max(1, int(round(self.d * v.numel())))
        idx = v.reshape(-1).abs().topk(k).indices
        vals = self._values(v.reshape(-1)[idx])
        out = torch.zeros_like(v)
        out.view(-1)[idx] = vals
        scale_bits = 32.0 * math.ceil(k / self.block) if self.vf in ("int8", "int4") else 0.0
        return out, k * FORMAT_BITS[self.vf] + scale_bits + v.numel() * entropy_bits(self.d)

    def _values(self, x: torch.Tensor) -> torch.Tensor:
        if self.vf == "fp32":
            return x
        if self.vf == "bf16":
            return x.bfloat16().float()
        import _tagc

        buf = torch.empty(_tagc.quant_bytes(x.numel(), self.vf, self.block), dtype=torch.uint8)
        _tagc.quant_encode(buf, None, x.contiguous(), self.vf, self.block)
        out = torch.zeros_like(x)
        _tagc.quant_decode_add(out, buf, self.vf, self.block)
        return out


class Reducer:
    """Turns the ranks' gradients of one step into what the optimizer sees."""

    def __init__(self, name: str, opts: Dict[str, str], ranks: int) -> None:
        self.name, self.ranks = name, ranks
        self.comp = None if name in ("dense", "gtopk") else Compressor(opts)
        self.d = float(opts.get("d", 1.0))
        self.state: Dict[Any, torch.Tensor] = {}

    def reduce(self, pname: str, grads: List[torch.Tensor],
               thresholds: Optional[List[torch.Tensor]]) -> Tuple[torch.Tensor, float]:
        """Mean over ranks of what each sends for one tensor; bits sent per rank."""
        outs, bits = [], 0.0
        for r, g in enumerate(grads):
            key = (pname, r)
            if self.name in ("topk", "quant"):
                v = g + self.state.get(key, torch.zeros_like(g))
                c, b = self.comp(v)
                self.state[key] = v - c
                outs.append(c)
            elif self.name in ("ef21", "ef21m"):
                if self.name == "ef21m":
                    m = self.state.get(("m",) + key, g.clone())
                    g = self.state[("m",) + key] = 0.9 * m + 0.1 * g
                h = self.state.get(key, torch.zeros_like(g))
                c, b = self.comp(g - h)
                self.state[key] = h + c
                outs.append(h + c)
            elif self.name == "dgc":
                u = 0.9 * self.state.get(("u",) + key, torch.zeros_like(g)) + g
                v = self.state.get(key, torch.zeros_like(g)) + u
                c, b = self.comp(v)
                sent = c != 0
                self.state[key] = v.masked_fill(sent, 0)
                self.state[("u",) + key] = u.masked_fill(sent, 0)
                outs.append(0.1 * c)  # back to gradient units: AdamW adds its own momentum
            else:  # gtopk
                v = g + self.state.get(key, torch.zeros_like(g))
                c = torch.where(v.abs() >= thresholds[r], v, torch.zeros_like(v))
                self.state[key] = v - c
                kept = int((c != 0).sum())
                b = 32.0 * kept + v.numel() * entropy_bits(kept / v.numel())
                outs.append(c)
            bits += b
        return sum(outs) / self.ranks, bits / self.ranks


def run(spec: str, args: argparse.Namespace, data: token_data.TokenData,
        vocab: int) -> Dict[str, Any]:
    """Train once with one method; returns loss, bits and the mechanism measurements."""
    name, opts = parse_method(spec)
    dense_until = float(opts.pop("dense", 0.0)) * args.steps
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(block_size=args.block_size, vocab_size=(vocab + 63) // 64 * 64,
                          n_layer=2, n_head=4, n_embd=256))
    # the paper's selection (TAGCConfig's default is now every layer)
    cfg = tagc.TAGCConfig(mode="dense", layers="non_attention", min_numel=2 ** 16)
    params = dict(model.named_parameters())  # the tied LM head appears as wte only
    comp = {f"{mn}.{pn}" if mn else pn for mn, mod in model.named_modules()
            for pn, p in mod.named_parameters(recurse=False)
            if tagc.select_parameter(cfg, mn, mod, pn, p)} & set(params)
    opt = configure_optimizer(model, decayed_parameter_names(model), 0.1, args.lr, (0.9, 0.95))
    red = Reducer(name, opts, args.ranks)
    upd = {n: 0.0 for n in comp}
    cos_sum, cos_n, bits, elems, curve = 0.0, 0, 0.0, 0, []
    for it in range(args.steps):
        grads = []
        for r in range(args.ranks):
            x, y = data.get_batch("train", args.batch_size, args.block_size,
                                  (args.seed, 0, it, 0, r))  # train_gpt2.py's draw
            model.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            grads.append({n: p.grad.detach().clone() for n, p in params.items()})
        thresholds = None
        if name == "gtopk" and it >= dense_until:
            thresholds = []
            for r in range(args.ranks):
                allv = torch.cat([(grads[r][n] + red.state.get((n, r), 0)).abs().flatten()
                                  for n in sorted(comp)])
                k = max(1, int(red.d * allv.numel()))
                thresholds.append(allv.kthvalue(allv.numel() - k + 1).values)
        dots = norms_t = norms_g = 0.0
        for n, p in params.items():
            gs = [g[n] for g in grads]
            mean = sum(gs) / args.ranks
            if n not in comp or name == "dense" or it < dense_until:
                p.grad = mean
                if n in comp:
                    bits += 32.0 * p.numel()
                    elems += p.numel()
                continue
            p.grad, b = red.reduce(n, gs, thresholds)
            bits += b
            elems += p.numel()
            dots += float((p.grad * mean).sum())
            norms_t += float(mean.pow(2).sum())
            norms_g += float(p.grad.pow(2).sum())
        if norms_t > 0 and norms_g > 0:
            cos_sum += dots / math.sqrt(norms_t * norms_g)
            cos_n += 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = lr_at(it, args)
        for group in opt.param_groups:
            group["lr"] = lr
        before = {n: params[n].detach().clone() for n in comp}
        opt.step()
        for n in comp:
            upd[n] += float((params[n].detach() - before[n]).norm())
        if (it + 1) % args.eval_interval == 0 or it + 1 == args.steps:
            curve.append((it + 1, evaluate(model, data, args)))
    sqrt_v = {n: float(opt.state[params[n]]["exp_avg_sq"].sqrt().mean()) for n in comp}
    # (N-1)/N of a rank's messages leave it (its own shard stays): bits per parameter
    # per rank as the hook counts them, for N = args.ranks
    share = (args.ranks - 1) / args.ranks
    return {"method": spec, "steps": args.steps, "seed": args.seed, "data": args.data,
            "val_loss": curve[-1][1], "bits_per_param": share * bits / max(elems, 1),
            "update": upd, "sqrt_v": sqrt_v, "cos": cos_sum / max(cos_n, 1), "curve": curve}


def groups(names: Sequence[str]) -> Dict[str, List[str]]:
    """Compressed parameters by role: MLP, attention output projection, embedding."""
    out: Dict[str, List[str]] = {"mlp": [], "attn.c_proj": [], "wte": []}
    for n in names:
        key = "mlp" if ".mlp." in n else "attn.c_proj" if "attn" in n else "wte"
        out[key].append(n)
    return out


def table(results: List[Dict[str, Any]]) -> str:
    """Markdown: each method against the dense run of the same invocation."""
    base = results[0]
    g = groups(sorted(base["update"]))
    head = ("| method | val loss | vs dense | bits/param | update norm vs dense "
            "(mlp / attn.c_proj / wte) | sqrt(v) vs dense (mlp / attn.c_proj / wte) | cos |")
    lines = [head, "|---|---|---|---|---|---|---|"]

    def ratio(r: Dict[str, Any], key: str) -> str:
        return " / ".join(f"{sum(r[key][n] for n in ns) / sum(base[key][n] for n in ns):.2f}"
                          for ns in g.values())

    for r in results:
        lines.append(f"| {r['method']} | {r['val_loss']:.4f} | "
                     f"{100 * (r['val_loss'] / base['val_loss'] - 1):+.2f}% | "
                     f"{r['bits_per_param']:.2f} | {ratio(r, 'update')} | "
                     f"{ratio(r, 'sqrt_v')} | "
                     f"{'-' if r is base else format(r['cos'], '.3f')} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Run dense and every method; print a table; append JSON lines to --out."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("methods", nargs="+", help="methods (see below); dense is always run first")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data", default="stdlib", help="as train_gpt2.py --data")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval_interval", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="out/sim_ablation.jsonl", help="JSON lines, appended")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    # the tokenizer and token cache train_gpt2.py uses
    meta = token_data.prepare(token_data.get_source(args.data, 5.0),
                              token_data.get_tokenizer("auto"), Path("data_cache"))
    data = token_data.TokenData(meta)
    specs = ["dense"] + [m for m in args.methods if m != "dense"]
    for s in specs:
        parse_method(s)
    results = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for s in specs:
        t0 = time.time()
        r = run(s, args, data, meta["vocab_size"])
        r["seconds"] = round(time.time() - t0)
        results.append(r)
        print(f"{s}: val loss {r['val_loss']:.4f}, {r['bits_per_param']:.2f} bits/param, "
              f"{r['seconds']} s", flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
    print(table(results))
    return results


if __name__ == "__main__":
    main()
