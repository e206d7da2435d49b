#!/usr/bin/env bash
# What a session runs first on a borrowed GPU (issue 39): build _tagc with its CUDA
# kernels for this GPU in a scratch folder, run the cuda tests, check every CUDA codec op
# bit for bit against the C op, exercise the hook's CUDA path on one rank with each
# preset, time the kernels against a device copy and a GPT-2 124M step without and with
# the codec, run two ranks sharing the GPU over gloo against the CPU path, and write one
# report ($OUT/gpu_report.md, else docs/gpu/report-<UTC>.md).
# Each part runs even if an earlier one failed; exit status 1 if any failed.  No network.
#
# Usage: bash scripts/gpu_check.sh [--dry-run] [--out DIR] [--parts build,tests,...]
#   --dry-run   no GPU: the same script on the CPU paths and the CUDA emulation
#               (cuda/emu); the report goes to a temporary folder
#   env: PYTHON (default python3), TAGC_COMMIT (the commit, when the copy has no .git)
# The parts are scripts/bench/tagc_bench/gpu_check.py (bash scripts/gpu_check.sh --help).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# the checkout's package and the scripts' helpers (scripts/bench/tagc_bench) on the path,
# never the current folder (it may hold an in-place _tagc built for another Python or
# without the kernels)
export PYTHONPATH="$PWD:$PWD/scripts/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
exec "$PY" -m tagc_bench.gpu_check "$@"
