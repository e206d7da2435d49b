/*
 * dlpack_min.h - the subset of the DLPack ABI (the legacy, unversioned
 * "dltensor" capsule) that tagc_args.c reads.  Written from the public
 * DLPack specification; only the layout matters, so only what is read is
 * named.
 */
#ifndef TAGC_DLPACK_MIN_H
#define TAGC_DLPACK_MIN_H

#include <stdint.h>

/* DLDeviceType values used here. */
enum {
    TAGC_DL_CPU = 1,
    TAGC_DL_CUDA = 2,
    TAGC_DL_CUDA_HOST = 3,
    TAGC_DL_CUDA_MANAGED = 13
};

/* DLDataTypeCode values used here. */
enum {
    TAGC_DL_INT = 0,
    TAGC_DL_UINT = 1,
    TAGC_DL_FLOAT = 2,
    TAGC_DL_BFLOAT = 4
};

typedef struct {
    int32_t device_type;
    int32_t device_id;
} tagc_dl_device;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} tagc_dl_dtype;

typedef struct {
    void *data;
    tagc_dl_device device;
    int32_t ndim;
    tagc_dl_dtype dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} tagc_dl_tensor;

typedef struct tagc_dl_managed {
    tagc_dl_tensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct tagc_dl_managed *self);
} tagc_dl_managed;

#endif /* TAGC_DLPACK_MIN_H */
