#!/usr/bin/env bash
# sanitize.sh - the C codec under AddressSanitizer + UndefinedBehaviorSanitizer:
#   1. builds csrc/*.c kernels + fuzz/test_kernels.c and runs the C tests;
#   2. builds fuzz/fuzz_decoder.c as a libFuzzer target (clang; both builds at once,
#      JOBS compilers, default one per CPU) and fuzzes the
#      decoder inputs for FUZZ_SECONDS (default 30) in total; without clang it
#      drives the same target with random inputs under gcc instead.
# Any sanitizer finding, failed check or fuzzer crash exits non-zero.
#
# Needs: gcc (build-essential).  clang for libFuzzer: installed here with
# `apt-get install -y clang` when missing and running as root (set
# SANITIZE_NO_INSTALL=1 to skip; the gcc driver is used then).
# Env: FUZZ_SECONDS (total fuzz time), SANITIZE_OUT (build dir, default
# build/sanitize).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${SANITIZE_OUT:-$ROOT/build/sanitize}"
FUZZ_SECONDS="${FUZZ_SECONDS:-30}"
mkdir -p "$OUT"

# every C file of the codec: all of csrc/ (the CPython module lives in tagc/_ext/)
KERNELS=("$ROOT"/csrc/*.c)
SAN=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
CFLAGS=(-std=c11 -O1 -g -Wall -Wextra -Werror -I"$ROOT/csrc")
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:strict_string_checks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

if ! command -v clang >/dev/null 2>&1 && [ "${SANITIZE_NO_INSTALL:-0}" != 1 ] \
        && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "sanitize: installing clang (libFuzzer)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null
fi

# Both sanitizer builds, one object per compiler process and one process per core:
# most of this script's time (csrc/fp4.c alone takes 30-40 s at -O1 under the sanitizers).
if command -v clang >/dev/null 2>&1; then
    FUZZ_CC=(clang "${CFLAGS[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all)
    FUZZ_MAIN=("$ROOT/fuzz/fuzz_decoder.c")
    FUZZ_BIN="$OUT/fuzz_decoder"
else
    FUZZ_CC=(gcc "${CFLAGS[@]}" "${SAN[@]}")
    FUZZ_MAIN=("$ROOT/fuzz/fuzz_decoder.c" "$ROOT/fuzz/fuzz_standalone.c")
    FUZZ_BIN="$OUT/fuzz_standalone"
fi
GCC=(gcc "${CFLAGS[@]}" "${SAN[@]}")
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
mkdir -p "$OUT/obj/test" "$OUT/obj/fuzz"
TEST_OBJS=() FUZZ_OBJS=() failed=0
# compile <object> <source> <compiler and flags...>: in the background, at most JOBS at once
compile() {
    local obj=$1 src=$2
    shift 2
    while [ "$(jobs -pr | wc -l)" -ge "$JOBS" ]; do wait -n || failed=1; done
    "$@" -c "$src" -o "$obj" &
}
for src in "${KERNELS[@]}"; do
    name=$(basename "$src" .c)
    compile "$OUT/obj/fuzz/$name.o" "$src" "${FUZZ_CC[@]}"
    compile "$OUT/obj/test/$name.o" "$src" "${GCC[@]}"
    FUZZ_OBJS+=("$OUT/obj/fuzz/$name.o") TEST_OBJS+=("$OUT/obj/test/$name.o")
done
compile "$OUT/obj/test/test_kernels.o" "$ROOT/fuzz/test_kernels.c" "${GCC[@]}"
TEST_OBJS+=("$OUT/obj/test/test_kernels.o")
for src in "${FUZZ_MAIN[@]}"; do
    name=$(basename "$src" .c)
    compile "$OUT/obj/fuzz/$name.o" "$src" "${FUZZ_CC[@]}"
    FUZZ_OBJS+=("$OUT/obj/fuzz/$name.o")
done
for pid in $(jobs -p); do wait "$pid" || failed=1; done
[ "$failed" = 0 ] || { echo "sanitize: a sanitizer build failed"; exit 1; }
"${GCC[@]}" "${TEST_OBJS[@]}" -lm -o "$OUT/test_kernels"
"${FUZZ_CC[@]}" "${FUZZ_OBJS[@]}" -lm -o "$FUZZ_BIN"

echo "sanitize: C kernel tests (gcc, ASan+UBSan)"
"$OUT/test_kernels"

if [ "$FUZZ_BIN" = "$OUT/fuzz_decoder" ]; then
    echo "sanitize: libFuzzer on the decoder for ${FUZZ_SECONDS}s (clang, ASan+UBSan)"
    mkdir -p "$OUT/corpus"
    # Artifacts (crash inputs) land in $OUT; a finding makes libFuzzer exit non-zero.
    "$FUZZ_BIN" -max_total_time="$FUZZ_SECONDS" -max_len=16384 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$OUT/" "$OUT/corpus" 2>"$OUT/fuzz.log" || {
        tail -50 "$OUT/fuzz.log"; echo "sanitize: fuzzer finding (see $OUT)"; exit 1; }
    grep -E "stat::number_of_executed_units|Done" "$OUT/fuzz.log" || true
else
    echo "sanitize: clang not found; random-input driver for ${FUZZ_SECONDS}s (gcc, ASan+UBSan)"
    "$FUZZ_BIN" "$FUZZ_SECONDS"
fi
echo "sanitize: OK"
