/*
 * fuzz_standalone.c - drives LLVMFuzzerTestOneInput with random inputs for a
 * given number of seconds, for compilers without libFuzzer (gcc).  Usage:
 * fuzz_standalone SECONDS [SEED].
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 10.0;
    uint64_t s = argc > 2 ? strtoull(argv[2], NULL, 10) : 1;
    static uint8_t buf[1 << 16];
    time_t start = time(NULL);
    long runs = 0;
    while (difftime(time(NULL), start) < seconds) {
        for (int r = 0; r < 256; r++, runs++) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            size_t len = (size_t)(s % sizeof buf);
            if (runs & 1)
                len %= 512; /* many short inputs: small sizes and edge cases */
            uint64_t x = s;
            for (size_t i = 0; i < len; i++) {
                x = x * 6364136223846793005ULL + 1442695040888963407ULL;
                /* mostly bytes likely to matter: 0x00, 0xff, NaN/Inf exponents */
                uint8_t b = (uint8_t)(x >> 56);
                buf[i] = (x & 3) == 0 ? 0 : (x & 3) == 1 ? 0xff : (x & 7) == 2 ? 0x7f : b;
            }
            LLVMFuzzerTestOneInput(buf, len);
        }
    }
    printf("fuzz_standalone: %ld inputs in %.0f s, no finding\n", runs, seconds);
    return 0;
}
