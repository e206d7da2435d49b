/*
 * cuda_module_check.c - built and run by scripts/tools/check_cuda.sh with a plain
 * C11 compiler, beside cuda/host_check.c: the binding's CUDA glue
 * (tagc_cuda_module.h) must compile as strict C, and without a usable GPU
 * must say so instead of crashing: no device available, and a call's setup
 * fails with TAGC_ERR_CUDA before any workspace exists.
 */
#include <stdint.h>
#include <stdio.h>

#include "tagc_cuda_module.h"

int main(void)
{
    int devices = 0, failed = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess)
        devices = 0;
    int avail = tagc_cudamod_available();
    if (avail != (devices > 0)) {
        fprintf(stderr, "FAIL tagc_cudamod_available: got %d with %d device(s)\n", avail,
                devices);
        failed++;
    }
    if (devices == 0) {
        /* A fake address: begin must overwrite it, never free it. */
        void *ws = (void *)(uintptr_t)0x100000;
        int prev = -1;
        tagc_status st = tagc_cudamod_begin(0, 1024, 0, &ws, &prev);
        if (st != TAGC_ERR_CUDA || ws != NULL) {
            fprintf(stderr, "FAIL tagc_cudamod_begin without a GPU: status %d, ws %p\n",
                    (int)st, ws);
            failed++;
        }
    } else {
        printf("cuda_module_check: %d CUDA device(s) present, no-GPU checks skipped\n",
               devices);
    }
    printf("cuda_module_check: %s\n", failed ? "FAILED" : "passed");
    return failed != 0;
}
