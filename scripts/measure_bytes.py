"""Bytes sent per rank by TAGC relative to plain FSDP, compressed units only.

Runs N gloo ranks on 127.0.0.1 (CPU), a model of big Linear layers sharded by
FSDP1 with TAGC's wrap policy, a few backward passes per mode, and prints, for
each mode, the bytes this rank sent (``stats()["compressed_total"]["wire_bytes"]``:
all-to-all minus the self chunk, ring all-reduce 2(N-1)/N, reduce unless
destination, control messages included) over what FSDP's ideal ring
reduce-scatter would send for the same calls ((N-1)/N * n * 4 bytes).
Everything printed is measured by the hook's counters in this run.

Usage: python scripts/measure_bytes.py [--world-sizes 2 4] [--theta 0.9875]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any, Dict, List

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from dist_helpers import run_dist  # noqa: E402

MODES = [
    ("paper 10x 1-bit", dict(mode="paper", ratio=10, index_bits=1)),
    ("paper 10x 4-bit", dict(mode="paper", ratio=10, index_bits=4)),
    ("exact", dict(mode="exact")),
    ("sparse", dict(mode="sparse")),
    ("quant int4", dict(mode="quant", quant_format="int4")),
    ("quant ternary", dict(mode="quant", quant_format="ternary")),
    ("dense", dict(mode="dense")),
]


def _worker(rank: int, n: int, theta: float, width: int, steps: int) -> List[Dict[str, Any]]:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("tagc_hook").setLevel(logging.ERROR)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import tagc_hook as tagc

    rows = []
    for label, kw in MODES:
        if kw["mode"] in ("exact", "sparse"):
            kw = dict(kw, theta=theta)
        cfg = tagc.TAGCConfig(layers="all", min_numel=4096, **kw)
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
                     "units": st["units"], "density": st["density"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--theta", type=float, default=0.9875)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    print(f"# compressed units only; theta={args.theta} for exact/sparse (paper modes: theta "
          "from ratio; quant: every entry, blocks of 256 with one fp32 scale); "
          f"Linear {args.width}x{4 * args.width} and back, FSDP1, gloo, {args.steps} steps")
    print(f"{'N':>2} {'mode':<16} {'sent/rank (MB)':>14} {'plain FSDP (MB)':>15} "
          f"{'ratio':>8} {'1/ratio':>8} {'unpeeled':>8} {'coll.drop':>9}")
    for n in args.world_sizes:
        rows = run_dist(_worker, n, args.theta, args.width, args.steps, timeout=600)[0]
        for r in rows:
            ratio = r["wire"] / r["default"]
            print(f"{n:>2} {r['mode']:<16} {r['wire'] / 1e6:>14.4f} {r['default'] / 1e6:>15.4f} "
                  f"{ratio:>8.4f} {1 / ratio:>8.2f} {int(r['unpeeled']):>8} "
                  f"{int(r['collision_dropped']):>9}")


if __name__ == "__main__":
    main()
