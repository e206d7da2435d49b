/*
 * select.cu - tagc_cuda_select_kth: k-th largest magnitude by radix select
 * (radix_select.cuh), no host sync.
 */
#include "radix_select.cuh"

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
    if (tau == NULL || (x == NULL && n > 0))
        return TAGC_ERR_ARG;
    if (!tagc_dt_valid(x_dtype))
        return TAGC_ERR_DTYPE;
    if (n < 0 || n > TAGC_MAX_N || k < 0 || k > n)
        return TAGC_ERR_RANGE;
    tagc_carver c;
    tagc_status s = tagc_ws_open(&c, workspace, workspace_bytes,
                                 tagc_cuda_select_kth_workspace_size(n));
    if (s != TAGC_OK)
        return s;
    tagc_sel_ws w;
    tagc_sel_carve(&c, n, &w);
    tagc_gr src = {x, NULL, (int)x_dtype, TAGC_DT_NONE};
    return tagc_sel_enqueue(src, n, k, &w, tau, NULL, stream);
}
