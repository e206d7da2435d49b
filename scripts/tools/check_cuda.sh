#!/usr/bin/env bash
# Compile every cuda/*.cu with all warnings as errors (nvcc front end, host
# compiler and ptxas) for each architecture in TAGC_CUDA_ARCHS (default
# "80;90"), then build and run two plain C11 programs through the static
# CUDA runtime: cuda/host_check.c, which includes cuda/tagc_cuda.h and links
# every launcher, and tagc/_ext/cuda_module_check.c, which links the
# binding's CUDA glue (tagc/_ext/tagc_cuda_module.c, one layer up).  Without
# a GPU both still run (argument checks need none, and the first real CUDA
# call must come back as TAGC_ERR_CUDA).  Exits non-zero on the first
# failure.  Needs nvcc (CUDA >= 12) and gcc; no GPU, no driver.
#
# Usage: scripts/tools/check_cuda.sh        (env: TAGC_CUDA_ARCHS, NVCC, CC, JOBS)
set -euo pipefail

cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
CC=${CC:-gcc}
ARCHS=${TAGC_CUDA_ARCHS:-"80;90"}
JOBS=${JOBS:-2}
if [ ! -x "$NVCC" ]; then
    echo "check_cuda: nvcc not found (set NVCC=/path/to/nvcc)" >&2
    exit 1
fi
# nvcc may be a wrapper on PATH: ask it where its toolkit lives.
CUDA_HOME=${CUDA_HOME:-$(cd "$("$NVCC" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 \
    | sed -n 's/^#\$ TOP=//p' | head -1)" && pwd)}

GENCODE=()
IFS=';, ' read -r -a arch_list <<< "$ARCHS"
for a in "${arch_list[@]}"; do
    [ -n "$a" ] || continue
    a=${a#sm_}
    GENCODE+=("-gencode" "arch=compute_${a},code=sm_${a}")
done
if [ ${#GENCODE[@]} -eq 0 ]; then
    echo "check_cuda: no architecture in TAGC_CUDA_ARCHS='$ARCHS'" >&2
    exit 1
fi

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
export NVCC OUT
NVFLAGS="-std=c++17 -O3 -Werror all-warnings -Xptxas -Werror,-warn-spills,-warn-lmem-usage -Xcompiler -Wall,-Wextra,-Werror ${GENCODE[*]}"
export NVFLAGS

start=$(date +%s)
echo "check_cuda: $("$NVCC" --version | tail -1), archs: $ARCHS"
# One nvcc per file, all architectures at once; JOBS files in parallel.
ls cuda/*.cu | xargs -P "$JOBS" -I{} sh -c \
    'f={}; o="$OUT/$(basename "$f" .cu).o"; $NVCC $NVFLAGS -c "$f" -o "$o" \
     || { echo "check_cuda: FAILED $f" >&2; exit 255; }; echo "  ok $f"'


# The headers are plain C: compile the checks with the C compiler, strict.
# -Icuda: the glue in tagc/_ext/ includes tagc_cuda.h from the layer below.
cc_strict() {
    "$CC" -std=c11 -Wall -Wextra -Wpedantic -Werror -I"$CUDA_HOME/include" -Icuda \
        -c "$1" -o "$2"
}
cc_strict cuda/host_check.c "$OUT/host_check.o"
"$NVCC" -o "$OUT/host_check" "$OUT"/*.o -cudart static
"$OUT/host_check"
# The glue links without the kernels (it calls no launcher): its own program.
mkdir "$OUT/ext"
for c in tagc/_ext/cuda_module_check.c tagc/_ext/tagc_cuda_module.c; do
    cc_strict "$c" "$OUT/ext/$(basename "$c" .c).o"
done
"$NVCC" -o "$OUT/cuda_module_check" "$OUT"/ext/*.o -cudart static
"$OUT/cuda_module_check"
echo "check_cuda: all $(ls cuda/*.cu | wc -l) .cu files compiled with -Werror for" \
     "archs $ARCHS; host and module glue checks passed ($(( $(date +%s) - start ))s)"
