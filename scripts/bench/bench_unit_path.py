"""The hook's reduce-scatter calls of one training step on the CPU, general path against
unit path.

Every unit ``tagc.shard_model`` would make of a GPT-2 (``tagc_bench.gpu_step``'s shapes)
gets its ``UnitReducer`` with a preset's config, rank 0 of two ranks on the loopback
stand-in for rank 1 (``tagc_bench.cuda_hook.LoopbackComm``: a copy in place of the
network), and is called once per pass on a random fp32 gradient of its padded size, first
with ``UnitReducer.UNIT_PATH`` off (the residual decoded into an fp32 copy, the general
transport, the codes written back), then on (``_tagc.quant_unit_encode`` /
``quant_unit_decode``).  Prints the median time of a pass (every unit once: one rank's
reduce-scatter work of a step, the network aside) for each path, alternating the two.

    python3 scripts/bench/bench_unit_path.py                       # GPT-2 124M, tagc-balanced
    python3 scripts/bench/bench_unit_path.py --shape tiny --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import tagc_hook as tagc
from tagc.train.model import GPT, GPTConfig
from tagc_bench.cuda_hook import loopback, unit_reducers
from tagc_bench.gpu_step import SHAPES, unit_params


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="gpt2-124m", choices=sorted(SHAPES))
    ap.add_argument("--preset", default="balanced")
    ap.add_argument("--repeats", type=int, default=5, help="passes per path (the first is "
                    "a warm-up), the two paths alternating")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a rank's share "
                    "of the cores)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = tagc.TAGCConfig.preset(args.preset)
    model = GPT(GPTConfig(block_size=1024, **SHAPES[args.shape]))
    pad = 2 * cfg.quant_block  # whole shards of whole blocks, as FSDP pads a unit
    sizes = [-(-sum(p.numel() for p in ps) // pad) * pad for _, ps in unit_params(model, cfg)]
    del model
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for n in sizes]
    paths = {}
    for unit_path in (False, True):
        rs = unit_reducers(cfg, sizes, torch.device("cpu"), 2, unit_path=unit_path)
        paths["unit" if unit_path else "general"] = (rs, [torch.empty(n // 2) for n in sizes])
    times = {name: [] for name in paths}
    with loopback():
        for _ in range(args.repeats):
            for name, (rs, outs) in paths.items():
                t0 = time.perf_counter()
                for r, g, o in zip(rs, grads, outs):
                    r.reduce(g, o)
                times[name].append(time.perf_counter() - t0)
    taken = {name: [r.unit_call for r in rs] for name, (rs, _) in paths.items()}
    print(f"{args.shape}, {args.preset}, 2 ranks (rank 0, loopback), {len(sizes)} units, "
          f"{sum(sizes) / 1e6:.1f}M values, {args.threads} thread(s); unit path taken by "
          f"{sum(taken['unit'])} of {len(sizes)} units")
    for name, ts in times.items():
        kept = ts[1:] if len(ts) > 1 else ts
        print(f"  {name:8s} path: {1e3 * statistics.median(kept):8.1f} ms a pass "
              f"(median of {len(kept)}; min {1e3 * min(kept):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
