#!/usr/bin/env bash
# GPT-2 124M quality on one GPU in minutes (issue 57 item 4): plain, tagc-balanced and
# tagc-full, about 1000 steps each, two ranks simulated in one process with the hook's own
# codec calls, then the first 20 steps of each again as two real processes (FSDP2 and the
# hook, gloo, sharing the GPU) whose losses must match the simulation's within 1e-3
# (scripts/bench/tagc_bench/gpu_quality.py says what is simulated and what not).  Writes the report and its JSON ($OUT/gpu_quality.md and .json when $OUT is set,
# else docs/gpu/quality-<UTC>.md and .json).  Run after scripts/gpu_check.sh.
#
# Usage: bash scripts/gpu_quality.sh [--dry-run] [--steps N] [--out DIR]
#   --dry-run   no GPU: the CPU, a tiny shape, six steps (a check of the code); the
#               report goes to a temporary folder unless --out says where
#   env: PYTHON (default python3)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD:$PWD/scripts/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
dry=0 steps=1000 dir=${OUT:-}
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --steps) steps=$2; shift ;;
        --out) dir=$2; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "gpu_quality.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
    shift
done
if [ "$dry" = 1 ]; then
    args=(--device cpu --shape tiny --steps 6 --context 64 --batch 2 --eval_every 3
          --eval_batches 2 --tie_steps 3)
    dir=${dir:-$(mktemp -d /tmp/tagc-gpu-quality-XXXXXX)}
else
    args=(--device cuda --steps "$steps")
fi
if [ -n "$dir" ]; then
    base="$dir/gpu_quality"
else
    base="docs/gpu/quality-$(date -u +%Y%m%d-%H%M%S)"
fi
mkdir -p "$(dirname "$base")"
"$PY" -m tagc_bench.gpu_quality "${args[@]}" --json "$base.json" --report "$base.md"
rc=$?
echo "gpu_quality: report $base.md (exit $rc)"
exit $rc
