/*
 * select.cu - tagc_cuda_select_kth: k-th largest magnitude by radix select
 * (radix_select.cuh), no host sync.
 */
#include "radix_select.cuh"
#include "../csrc/tagc_checks.h"

extern "C" size_t tagc_cuda_select_kth_workspace_size(int64_t n)
{
    tagc_carver c = {NULL, 0};
    tagc_sel_ws w;
    tagc_sel_carve(&c, n, &w);
    return tagc_carved_size(&c);
}

extern "C" tagc_status tagc_cuda_select_kth(float *tau, const void *x,
                                            tagc_dtype x_dtype, int64_t n,
                                            int64_t k, void *workspace,
                                            size_t workspace_bytes,
                                            cudaStream_t stream)
{
    tagc_status s = tagc_check_select_kth(tau, x, (int)x_dtype, n, k);
    if (s != TAGC_OK)
        return s;
    tagc_carver c;
    s = tagc_ws_open(&c, workspace, workspace_bytes, tagc_cuda_select_kth_workspace_size(n));
    if (s != TAGC_OK)
        return s;
    tagc_sel_ws w;
    tagc_sel_carve(&c, n, &w);
    tagc_gr src = {x, NULL, (int)x_dtype, TAGC_DT_NONE};
    return tagc_sel_enqueue(src, n, k, &w, tau, NULL, stream);
}
