#!/usr/bin/env bash
# sanitize.sh - the C codec under AddressSanitizer + UndefinedBehaviorSanitizer:
#   1. builds csrc/*.c kernels + fuzz/test_kernels.c and runs the C tests;
#   2. builds fuzz/fuzz_decoder.c as a libFuzzer target (clang) and fuzzes the
#      decoder inputs for FUZZ_SECONDS (default 40) in total; without clang it
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
FUZZ_SECONDS="${FUZZ_SECONDS:-40}"
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

echo "sanitize: C kernel tests (gcc, ASan+UBSan)"
gcc "${CFLAGS[@]}" "${SAN[@]}" "${KERNELS[@]}" "$ROOT/fuzz/test_kernels.c" -lm \
    -o "$OUT/test_kernels"
"$OUT/test_kernels"

if command -v clang >/dev/null 2>&1; then
    echo "sanitize: libFuzzer on the decoder for ${FUZZ_SECONDS}s (clang, ASan+UBSan)"
    clang "${CFLAGS[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
        "${KERNELS[@]}" "$ROOT/fuzz/fuzz_decoder.c" -lm -o "$OUT/fuzz_decoder"
    mkdir -p "$OUT/corpus"
    # Artifacts (crash inputs) land in $OUT; a finding makes libFuzzer exit non-zero.
    "$OUT/fuzz_decoder" -max_total_time="$FUZZ_SECONDS" -max_len=16384 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$OUT/" "$OUT/corpus" 2>"$OUT/fuzz.log" || {
        tail -50 "$OUT/fuzz.log"; echo "sanitize: fuzzer finding (see $OUT)"; exit 1; }
    grep -E "stat::number_of_executed_units|Done" "$OUT/fuzz.log" || true
else
    echo "sanitize: clang not found; random-input driver for ${FUZZ_SECONDS}s (gcc, ASan+UBSan)"
    gcc "${CFLAGS[@]}" "${SAN[@]}" "${KERNELS[@]}" "$ROOT/fuzz/fuzz_decoder.c" \
        "$ROOT/fuzz/fuzz_standalone.c" -lm -o "$OUT/fuzz_standalone"
    "$OUT/fuzz_standalone" "$FUZZ_SECONDS"
fi
echo "sanitize: OK"
