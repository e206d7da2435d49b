/* cuda/emu/cuda_runtime_api.h - see cuda_runtime.h beside it. */
#include "cuda_runtime.h"
