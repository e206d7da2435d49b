#!/usr/bin/env python3
"""Cost model of plain FSDP/HSDP and TAGC: bytes per rank and step time per step.

The command line of :mod:`tagc.bench.cost` (the model: configurations, layouts, links,
the library's size rules, the check against measured runs; its docstring says what is
modelled).  It prints the tables of a sweep over node counts, the check of
``docs/cost_model_runs.json`` (bytes counted at the ``torch.distributed`` call and on
the veth, step times; rows the file lists as untraceable are not checked), or a plot.
See ``docs/COST_MODEL.md``.

Usage:
    python3 scripts/bench/cost_model.py --params 124e6 --nodes 1,2,4,8 --ranks-per-node 8 \\
        --inter-gbit 25 --intra-gbit 400 --tflops 312 --mfu 0.4
    python3 scripts/bench/cost_model.py --check docs/cost_model_runs.json
    python3 scripts/bench/cost_model.py --cluster --gpus-per-node 8 --gpu-mem-gb 80 \\
        --nic-gbit 100,25 --models 124m,7b --explain     # your cluster: docs/CLUSTER.md
    python3 scripts/bench/cost_model.py --plot docs/cost-model.png --tflops 312
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from tagc.bench.cost import (DEFAULT_CODEC, DEFAULT_CONFIGS, DEFAULT_LAYERS, DEFAULT_UNITS,
                             DTYPE_BYTES, LAYER_POLICIES, MODELS, PRESETS, Cluster,
                             CollectiveRates, Config, ModelSpec, check, check_report,
                             codec_rates, default_selected_fraction, flops_compute_s,
                             generic_model, gpt2_124m, load_runs, make_config, report, sweep)


# --------------------------------------------------------------------------- plot


def plot(path: str, base: Cluster, nodes: Sequence[int], configs: Sequence[Config],
         models: Sequence[Tuple[ModelSpec, float]], codec: Dict[str, float],
         note: str) -> None:
    """Bytes per rank and step time against R for each model (matplotlib, lazily).

    Args:
        path: the PNG to write.
        base: the cluster.
        nodes: node counts R.
        configs: configurations.
        models: (model, compute seconds per step) pairs, one column each.
        codec: codec throughputs.
        note: the assumptions, printed under the figure.
    """
    import matplotlib  # noqa: PLC0415 - only the --plot path needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8.5), squeeze=False)
    for col, (model, compute) in enumerate(models):
        table = sweep(model, base, nodes, configs, compute, codec)
        for cfg in configs:
            by_r = table[cfg.name]
            axes[0][col].plot(nodes, [by_r[r].bytes_per_rank / 1e6 for r in nodes], "-",
                              marker="o", ms=3, label=cfg.name)
            axes[1][col].plot(nodes, [by_r[r].step_s for r in nodes], "-", marker="o",
                              ms=3, label=cfg.name)
        axes[0][col].set_title(f"{model.name}: bytes sent per rank per step")
        axes[1][col].set_title(f"{model.name}: step time (compute {compute:.3g} s)")
        axes[0][col].set_ylabel("MB per rank per step")
        axes[1][col].set_ylabel("seconds per step")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(f"nodes R ({base.ranks_per_node} ranks per node)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="best")
    fig.text(0.01, 0.005, note, fontsize=7, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def _int_list(text: str) -> List[int]:
    """argparse type: comma-separated node counts >= 1."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"node counts must be >= 1, got {text!r}")
    return out


def _codec_overrides(items: Iterable[str]) -> Dict[str, float]:
    """``--codec OP=VALUE`` items as a dict (checked by :func:`codec_rates`)."""
    out = {}
    for it in items:
        key, eq, val = it.partition("=")
        if not eq:
            raise ValueError(f"--codec: expected OP=VALUES_PER_S, got {it!r}")
        try:
            out[key] = float(val)
        except ValueError as e:
            raise ValueError(f"--codec {key}: not a number: {val!r}") from e
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="configurations: fsdp, hsdp, fsdp+P, hsdp+P (the hook's "
                                       "hsdp_allreduce=auto), hsdp+P/2phase, hsdp+P/gather "
                                       f"with P in {sorted(PRESETS)}; codec ops: "
                                       f"{', '.join(sorted(DEFAULT_CODEC))}")
    m = p.add_argument_group("model")
    m.add_argument("--params", type=float, help="parameters (e.g. 124e6, 7e9)")
    m.add_argument("--model", choices=sorted(MODELS),
                   help="a GPT-2 layout of this repository instead of --params")
    m.add_argument("--layers", choices=LAYER_POLICIES, default=DEFAULT_LAYERS,
                   help=f"selection policy of --model, of --plot's GPT-2 124M and of "
                        f"--params' default fraction (default {DEFAULT_LAYERS}, the one "
                        "tagc-balanced/lean/full use; non_attention: the attention QKV "
                        "inputs uncompressed, as before the presets changed and as "
                        "tagc-sparse/auto/dense still do).  It applies to every "
                        "configuration of the run; --check ignores it (each measured run "
                        "names its own layout)")
    m.add_argument("--selected-fraction", type=float, default=None,
                   help="with --params (and the 7B of --plot): fraction of parameters in "
                        "compressed units (default: the tiny GPT-2's under --layers, "
                        f"{default_selected_fraction('all'):.3f} for all, "
                        f"{default_selected_fraction('non_attention'):.3f} for "
                        "non_attention)")
    m.add_argument("--units", type=int, default=DEFAULT_UNITS,
                   help=f"with --params: FSDP units (default {DEFAULT_UNITS}, GPT-2 124M's)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                   help="node counts R, comma-separated")
    c.add_argument("--ranks-per-node", type=int, default=8, help="N (default 8)")
    c.add_argument("--intra-gbit", type=float, default=400.0,
                   help="per-rank bandwidth inside a node, Gbit/s (default 400)")
    c.add_argument("--inter-gbit", type=float, default=25.0,
                   help="per-node bandwidth between nodes, Gbit/s (default 25)")
    c.add_argument("--intra-latency-us", type=float, default=5.0,
                   help="per message inside a node (default 5 us)")
    c.add_argument("--inter-latency-us", type=float, default=30.0,
                   help="per message between nodes (default 30 us)")
    c.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    c.add_argument("--overlap", type=float, default=0.0,
                   help="fraction of compute that hides communication, 0..1 (default 0)")
    c.add_argument("--link-efficiency", type=float, default=1.0,
                   help="fraction of the bandwidth collectives reach (default 1)")
    c.add_argument("--collectives", metavar="JSON",
                   help="measured collective rates (scripts/bench/bench_collectives.py --out) of "
                        "your cluster: they replace the link bandwidths where they cover a "
                        "collective (measured at one R: predictions at other R reuse them)")
    w = p.add_argument_group("workload")
    w.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated configurations")
    w.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp32",
                   help="parameter/gradient dtype on the wire")
    w.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    w.add_argument("--compute-s", type=float, help="compute time per step (measured plain "
                   "step on a fast link)")
    w.add_argument("--tflops", type=float, help="peak TFLOP/s per rank: compute from "
                   "6 x params x tokens")
    w.add_argument("--mfu", type=float, default=0.4, help="with --tflops (default 0.4)")
    w.add_argument("--tokens-per-rank", type=int, default=8192,
                   help="with --tflops: tokens per rank per step (default 8 x 1024)")
    w.add_argument("--codec", action="append", default=[], metavar="OP=VALUES_PER_S",
                   help="codec throughput of one op (repeatable)")
    w.add_argument("--codec-speedup", type=float, default=1.0,
                   help="factor on the measured CPU codec throughputs (e.g. a GPU's)")
    a = p.add_argument_group("actions")
    a.add_argument("--cluster", action="store_true",
                   help="what TAGC would give on your cluster: models x nodes x FULL_SHARD/HSDP "
                        "x plain bf16/presets, memory per GPU included; its own options follow "
                        "it (--cluster --help; docs/CLUSTER.md)")
    a.add_argument("--check", metavar="FILE", help="compare with measured runs (JSON)")
    a.add_argument("--plot", metavar="PNG", help="bytes/rank and step time vs R for GPT-2 "
                   "124M and a 7B model")
    a.add_argument("--plot-7b-units", type=int, default=32 * 7 + 3,
                   help="FSDP units of the 7B model in --plot (default 227: a Llama-2-7B "
                        "under TAGC's wrapping, 7 linear units per layer + embedding, head, "
                        "root)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the arguments and print the tables, the check or the plot.

    Args:
        argv: arguments (default sys.argv[1:]).
    Returns:
        the exit code.
    """
    argv = sys.argv[1:] if argv is None else argv
    if "--cluster" in argv:  # its own command line (tagc.bench.cost.cluster)
        from tagc.bench.cost import cluster  # noqa: PLC0415 - only --cluster needs it

        print(cluster.run([x for x in argv if x != "--cluster"]))
        return 0
    p = build_parser()
    args = p.parse_args(argv)
    try:
        codec = codec_rates(_codec_overrides(args.codec), args.codec_speedup)
        if args.check:
            data = load_runs(args.check)
            print(check_report(check(data, codec), data=data))
            return 0
        coll = None
        if args.collectives:
            try:
                coll = CollectiveRates.from_report(json.loads(Path(args.collectives).read_text()),
                                                   args.collectives)
            except (OSError, ValueError) as e:
                p.error(f"--collectives {args.collectives}: {e}")
        base = Cluster(args.ranks_per_node, 1, args.intra_gbit, args.inter_gbit,
                       args.intra_latency_us * 1e-6, args.inter_latency_us * 1e-6,
                       args.backend, args.overlap, args.link_efficiency, coll)
        configs = [make_config(n.strip(), args.dtype, args.fsdp)
                   for n in args.configs.split(",") if n.strip()]
        if not configs:
            raise ValueError("--configs: no configuration given")
        fraction = (default_selected_fraction(args.layers) if args.selected_fraction is None
                    else args.selected_fraction)
        if args.plot:
            if args.tflops is None:
                raise ValueError("--plot draws two models: give --tflops (and --mfu, "
                                 "--tokens-per-rank) for their compute time")
            m124 = gpt2_124m(args.layers)
            m7 = generic_model(7e9, fraction, args.plot_7b_units, name="7B")
            pairs = [(m, flops_compute_s(m.params, args.tokens_per_rank, args.tflops, args.mfu))
                     for m in (m124, m7)]
            note = (f"{base.ranks_per_node} ranks/node; intra {base.intra_gbit:g} Gbit/s/rank, "
                    f"inter {base.inter_gbit:g} Gbit/s/node; {args.backend}, {args.dtype}; overlap "
                    f"{args.overlap:g}; compute 6 x params x {args.tokens_per_rank} tokens at "
                    f"{args.tflops:g} TFLOP/s x MFU {args.mfu:g}; codec: this CPU's measured "
                    f"throughput x {args.codec_speedup:g}; layers={args.layers}; 7B: "
                    f"{fraction:.3f} of parameters compressed. hsdp+P: the hook's default "
                    "form (all-gather at R = 2, two-phase from R = 3, lean from 4); /gather: the "
                    "all-gather form forced.")
            plot(args.plot, base, args.nodes, configs, pairs, codec, note)
            print(f"wrote {args.plot}")
            return 0
        if args.model and args.params:
            raise ValueError("give --params or --model, not both")
        if args.model:
            model = MODELS[args.model](layers=args.layers)
        elif args.params:
            model = generic_model(args.params, fraction, args.units)
        else:
            raise ValueError("give --params N (or --model NAME)")
        if args.compute_s is not None:
            compute = args.compute_s
        elif args.tflops is not None:
            compute = flops_compute_s(model.params, args.tokens_per_rank, args.tflops, args.mfu)
        else:
            compute = 0.0
            print("note: no --compute-s or --tflops: compute time 0 (communication and codec "
                  "only)\n")
        print(report(model, base, args.nodes, sweep(model, base, args.nodes, configs, compute,
                                                      codec)))
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # `cost_model.py ... | head` closed the pipe: point stdout at /dev/null so the
        # interpreter's flush at exit does not raise again (the `signal` docs' recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
