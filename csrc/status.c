/* status.c - status names and dtype sizes (tagc.h). */
#include "tagc.h"

const char *tagc_status_str(tagc_status s)
{
    switch (s) {
    case TAGC_OK: return "ok";
    case TAGC_ERR_ARG: return "invalid argument";
    case TAGC_ERR_RANGE: return "size or parameter out of range";
    case TAGC_ERR_CAPACITY: return "destination too small";
    case TAGC_ERR_NOMEM: return "out of memory";
    case TAGC_ERR_NONFINITE: return "non-finite value";
    case TAGC_ERR_CORRUPT: return "corrupt input";
    case TAGC_ERR_DTYPE: return "unsupported dtype";
    case TAGC_ERR_CUDA: return "CUDA error";
    }
    return "unknown status";
}

size_t tagc_dtype_size(tagc_dtype d)
{
    switch (d) {
    case TAGC_F32: return 4;
    case TAGC_BF16: return 2;
    }
    return 0;
}
