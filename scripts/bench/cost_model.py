#!/usr/bin/env python3
"""Cost model of plain FSDP/HSDP and TAGC: bytes per rank and step time per step.

The checkout's entry to ``python -m tagc.cost`` (:mod:`tagc.cost.cli`, which the wheel
ships): the same options and output; the one difference is where ``--predict-bench``
writes by default, a new ``docs/runs/predictions-MODEL-<UTC date-time>/`` of this
checkout, to commit with the figures it backs (``tagc_bench.outputs``).
See ``docs/COST_MODEL.md``; ``--help`` lists the options.

Usage:
    python3 scripts/bench/cost_model.py --params 124e6 --nodes 1,2,4,8 --ranks-per-node 8 \\
        --inter-gbit 25 --intra-gbit 400 --tflops 312 --mfu 0.4
    python3 scripts/bench/cost_model.py --check docs/cost_model_runs.json
    python3 scripts/bench/cost_model.py --cluster --gpus-per-node 8 --gpu-mem-gb 80 \\
        --nic-gbit 100,25 --models 124m,7b --explain     # your cluster: docs/CLUSTER.md
    python3 scripts/bench/cost_model.py --plot docs/cost-model.png --tflops 312
    python3 scripts/bench/cost_model.py --predict-bench gpt2-124m --plain-step RUN/results.json \\
        --link 200mbit=C200/collectives.json --link 1gbit=C1G/collectives.json \\
        --link none=CNONE/collectives.json
    python3 scripts/bench/cost_model.py --check docs/runs/predictions-gpt2-124m-DATE/predictions.json \\
        --measured docs/runs/step-DATE
"""
from __future__ import annotations

from pathlib import Path

from tagc.cost.cli import run
from tagc_bench.outputs import RUNS

# the checkout this script sits in (scripts/bench/): where --out's default folder goes
ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    run(runs_dir=ROOT / RUNS, prog="cost_model.py")
