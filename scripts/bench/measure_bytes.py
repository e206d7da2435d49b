"""Bytes sent per rank by TAGC relative to plain FSDP, compressed units only.

Runs N gloo ranks on 127.0.0.1 (CPU), a model of big Linear layers sharded by
FSDP1 with TAGC's wrap policy, a few backward passes per mode, and prints, for
each mode, the bytes this rank sent (``stats()["compressed_total"]["wire_bytes"]``:
all-to-all minus the self chunk, ring all-reduce 2(N-1)/N, reduce unless
destination, control messages included) over what FSDP's ideal ring
reduce-scatter would send for the same calls ((N-1)/N * n * 4 bytes).
Everything printed is measured by the hook's counters in this run.

Bits per parameter per rank = 8 * wire bytes / parameters of the compressed units
reduced (each reduction of a unit of P parameters counts P).

``--sweep``: ``auto`` at sparsities from 0 to 0.999, gradient bytes (wire minus the
4-byte non-finite vote) against plain FSDP's.  ``--simulate N ...``: the same table
for world sizes too many for this machine, from the wire-size rules alone (modes
whose sizes do not depend on the data: sparse, auto, quant, dense), for the units
this model has at that N.

Usage: python3 scripts/bench/measure_bytes.py [--world-sizes 2 4] [--theta 0.9875]
                                             [--sweep] [--simulate 8]
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Dict, List

import torch

from tagc.train.launch import run_dist

MODES = [
    ("paper 10x 1-bit", dict(mode="paper", ratio=10, index_bits=1)),
    ("paper 10x 4-bit", dict(mode="paper", ratio=10, index_bits=4)),
    ("exact", dict(mode="exact")),
    ("sparse", dict(mode="sparse")),
    ("sparse bf16", dict(mode="sparse", value_dtype="bf16")),
    ("auto", dict(mode="auto")),
    ("auto bf16", dict(mode="auto", value_dtype="bf16")),
    ("quant int4", dict(mode="quant", quant_format="int4")),
    ("quant ternary", dict(mode="quant", quant_format="ternary")),
    ("dense", dict(mode="dense")),
]


SWEEP = [0.0, 0.1, 0.3, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 0.95, 0.97, 0.9875, 0.999]


def _worker(rank: int, n: int, theta: float, width: int, steps: int,
            modes: List[Any]) -> List[Dict[str, Any]]:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("tagc_hook").setLevel(logging.ERROR)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import tagc_hook as tagc

    rows = []
    for label, kw in modes:
        if kw["mode"] in ("exact", "sparse", "auto") and "theta" not in kw:
            kw = dict(kw, theta=theta)
        # residual feedback, as when the table was measured (TAGCConfig derives EF21 for
        # quant otherwise, whose vote is 32 bytes instead of 4)
        cfg = tagc.TAGCConfig(layers="all", min_numel=4096, error_feedback=True, ef21=False, **kw)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width, bias=False), torch.nn.GELU(),
                                    torch.nn.Linear(4 * width, width, bias=False))
        model = FSDP(model, auto_wrap_policy=tagc.fsdp1_auto_wrap_policy(model, cfg),
                     device_id=torch.device("cpu"))
        state = tagc.register(model, cfg)
        g = torch.Generator().manual_seed(rank + 1)
        for _ in range(steps):
            x = torch.randn(16, width, generator=g)
            model(x).pow(2).mean().backward()
            model.zero_grad()
        st = state.stats()["compressed_total"]
        rows.append({"mode": label, "theta": cfg.theta, "wire": st["wire_bytes"],
                     "default": st["default_wire_bytes"], "handed": st["bytes_handed"],
                     "unpeeled": st["unpeeled"], "collision_dropped": st["collision_dropped"],
                     "units": st["units"], "density": st["density"],
                     "control": st["control_bytes"]})
    return rows


def bits(wire: float, default: float, n: int) -> float:
    """Bits per parameter per rank: plain FSDP sends (N-1)/N * 4 bytes per parameter."""
    return 8 * wire / (default * n / ((n - 1) * 4))


def simulate(n: int, theta: float, width: int) -> None:
    """The table's data-independent modes at world size n, from the size rules."""
    import _tagc

    import tagc_hook as tagc
    from tagc.config import keep_count
    from tagc.transports import pairs_wire

    sizes = [width * 4 * width] * 2  # the two Linear weights: one unit each
    print(f"\n# simulated N={n} (wire-size rules, no processes), theta={theta}")
    print(f"{'N':>2} {'mode':<16} {'bits/param/rank':>15} {'1/ratio':>8}")
    for label, kw in MODES:
        if kw["mode"] not in ("sparse", "auto", "quant", "dense"):
            continue
        cfg = tagc.TAGCConfig(**dict(kw, theta=theta) if kw["mode"] not in ("quant", "dense")
                              else kw)
        wire = default = 0.0
        for numel in sizes:
            s = -(-numel // n)
            k = keep_count(cfg.theta, s)
            if cfg.mode in ("sparse", "auto"):  # the transports' own rule, fp32 gradients
                msg = pairs_wire(cfg, s, k, torch.float32, {}).nbytes
            elif cfg.mode == "quant":
                msg = _tagc.quant_bytes(s, cfg.quant_format, cfg.quant_block)
            else:
                msg = s * 4
            control = 0 if cfg.mode == "dense" else 2 * (n - 1) / n * 4
            wire += (n - 1) * msg + control
            default += (n - 1) * s * 4
        print(f"{n:>2} {label:<16} {bits(wire, default, n):>15.4f} {default / wire:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--theta", type=float, default=0.9875)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="auto vs plain at theta 0..0.999")
    ap.add_argument("--simulate", type=int, nargs="*", default=[],
                    help="world sizes to simulate from the size rules")
    args = ap.parse_args()
    print(f"# compressed units only; theta={args.theta} for exact/sparse/auto (paper modes: "
          "theta from ratio; quant: every entry, blocks of 256 with one fp32 scale); "
          f"Linear {args.width}x{4 * args.width} and back, FSDP1, gloo, {args.steps} steps; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'N':>2} {'mode':<16} {'sent/rank (MB)':>14} {'plain FSDP (MB)':>15} "
          f"{'bits/param/rank':>15} {'1/ratio':>8} {'unpeeled':>8} {'coll.drop':>9}")
    for n in args.world_sizes:
        rows = run_dist(_worker, n, args.theta, args.width, args.steps, MODES,
                        timeout=600)[0]
        for r in rows:
            ratio = r["wire"] / r["default"]
            print(f"{n:>2} {r['mode']:<16} {r['wire'] / 1e6:>14.4f} {r['default'] / 1e6:>15.4f} "
                  f"{bits(r['wire'], r['default'], n):>15.4f} {1 / ratio:>8.2f} "
                  f"{int(r['unpeeled']):>8} {int(r['collision_dropped']):>9}")
    for n in args.simulate:
        simulate(n, args.theta, args.width)
    if args.sweep:
        modes = [(f"auto@{t}", dict(mode="auto", theta=t)) for t in SWEEP]
        print("\n# auto vs plain FSDP, N=2: gradient bytes (wire minus the non-finite vote)")
        print(f"{'theta':>6} {'auto (MB)':>10} {'plain (MB)':>10} {'auto/plain':>10} "
              f"{'with vote':>10}")
        for r in run_dist(_worker, 2, 0.0, args.width, args.steps, modes, timeout=600)[0]:
            grad = r["wire"] - r["control"]  # N=2: a ring all-reduce sends its bytes once
            print(f"{r['theta']:>6} {grad / 1e6:>10.4f} {r['default'] / 1e6:>10.4f} "
                  f"{grad / r['default']:>10.4f} {r['wire'] / r['default']:>10.6f}")


if __name__ == "__main__":
    main()
