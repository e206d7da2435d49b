/*
 * _tagcmodule.c - the CPython module `_tagc`: one entry point per function of
 * docs/module-api.md (the contract) over the C codec of tagc.h.  Arguments
 * are read, as checked DLPack views and scalars, by tagc_args.c (the ritual:
 * tagc_args.h).
 *
 * The top C layer: it includes the codec (csrc/) and, in CUDA builds, the
 * kernels' launchers (cuda/) and the glue beside it; nothing below includes
 * anything from here, so the codec and the kernels build without Python.
 */
#include "tagc_args.h"

#include <float.h>
#include <math.h>
#include <stdint.h>

#include "tagc.h"
#include "tagc_portable.h"
#ifdef TAGC_WITH_CUDA
#include "tagc_cuda.h"
#include "tagc_cuda_module.h"
#endif

/* ---- entry points ------------------------------------------------------ */

static PyObject *py_seed_derive(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"seed", "unit", "step", NULL};
    PyObject *a, *b, *c;
    const char *fn = "_tagc.seed_derive";
    uint64_t seed, unit, step;
    (void)m;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO", kwl, &a, &b, &c) ||
        tagc_py_arg_u64(fn, a, "seed", &seed) < 0 || tagc_py_arg_u64(fn, b, "unit", &unit) < 0 ||
        tagc_py_arg_u64(fn, c, "step", &step) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(tagc_seed_derive(seed, unit, step));
}

static PyObject *py_select_kth(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"x", "k", "out", "stream", NULL};
    PyObject *ox, *ok, *oout = NULL, *ostream = NULL;
    TAGC_BEGIN("select_kth");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OO", kwl, &ox, &ok, &oout, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(x, ox, "x", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE_OPT(out, has_out, oout, "out", TAGC_K_F32);
    int64_t k;
    TAGC_CHECK(tagc_py_arg_range(fn, ok, "k", 0, x->numel, &k));
    TAGC_CHECK(tagc_py_scalar_out_ok(&vs_, out, has_out));
    TAGC_CHECK(tagc_py_need_max_n(&vs_, x));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_CHECK(tagc_py_cuda_needs(fn, dev, has_out, "out"));
    float tau = 0;
    if (dev == TAGC_DEV_CUDA) { /* NaN/Inf: *out = NaN on the device, no exception */
        TAGC_RUN_CUDA(x, tagc_cuda_select_kth_workspace_size(x->numel),
                      tagc_cuda_select_kth(out->data, x->data, tagc_py_codec_dtype(x->kind),
                                           x->numel, k, ws_, wsb_, strm_));
    } else {
        TAGC_RUN(tagc_select_kth(&tau, x->data, tagc_py_codec_dtype(x->kind), x->numel, k));
    }
    if (st != TAGC_OK) {
        tagc_py_raise_status(m, fn, st, st == TAGC_ERR_NONFINITE ? "x holds NaN or Inf" : NULL);
        goto done;
    }
    ret = dev == TAGC_DEV_CUDA ? tagc_py_none_result() : tagc_py_float_result(out, has_out, tau);
done:
    tagc_py_views_release(&vs_);
    return ret;
}

static PyObject *py_sparsify(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"idx", "val", "bitmap", "residual", "grad", "k",
                          "out", "stream", NULL};
    PyObject *oidx, *oval, *obm, *ores, *ograd, *ok, *oout = NULL, *ostream = NULL;
    TAGC_BEGIN("sparsify");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|$OO", kwl, &oidx, &oval, &obm,
                                     &ores, &ograd, &ok, &oout, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(idx, oidx, "idx", TAGC_K_I32);
    TAGC_TAKE(val, oval, "val", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(bitmap, obm, "bitmap", TAGC_K_U8);
    TAGC_TAKE_OPT(res, has_res, ores, "residual", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(grad, ograd, "grad", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE_OPT(out, has_out, oout, "out", TAGC_K_F32);
    int64_t n = grad->numel, k;
    TAGC_CHECK(tagc_py_need_max_n(&vs_, grad));
    TAGC_CHECK(tagc_py_arg_range(fn, ok, "k", 0, n, &k));
    TAGC_CHECK(tagc_py_need_size(&vs_, idx, k, 0, "k"));
    TAGC_CHECK(tagc_py_need_size(&vs_, val, k, 0, "k"));
    TAGC_CHECK(tagc_py_need_size(&vs_, bitmap, tagc_bitmap_bytes(n), 0,
                                 "bitmap_bytes(grad.numel())"));
    if (has_res)
        TAGC_CHECK(tagc_py_need_size(&vs_, res, n, 1, "grad.numel()"));
    TAGC_CHECK(tagc_py_scalar_out_ok(&vs_, out, has_out));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_CHECK(tagc_py_cuda_needs(fn, dev, has_out, "out"));
    float tau = 0;
    if (dev == TAGC_DEV_CUDA) { /* NaN/Inf: *out = NaN, see tagc_cuda.h */
        TAGC_RUN_CUDA(grad, tagc_cuda_sparsify_workspace_size(n),
                      tagc_cuda_sparsify(idx->data, idx->numel, val->data,
                                         tagc_py_codec_dtype(val->kind), val->numel, bitmap->data,
                                         bitmap->numel, has_res ? res->data : NULL,
                                         tagc_py_codec_dtype(res->kind), grad->data,
                                         tagc_py_codec_dtype(grad->kind), n, k, out->data, ws_,
                                         wsb_, strm_));
    } else {
        TAGC_RUN(tagc_sparsify(idx->data, idx->numel, val->data, tagc_py_codec_dtype(val->kind),
                               val->numel, bitmap->data, bitmap->numel,
                               has_res ? res->data : NULL, tagc_py_codec_dtype(res->kind),
                               grad->data, tagc_py_codec_dtype(grad->kind), n, k, &tau));
    }
    if (st != TAGC_OK) {
        tagc_py_raise_status(m, fn, st, st == TAGC_ERR_NONFINITE
                                    ? "grad + residual holds NaN or Inf (nothing written)"
                                    : NULL);
        goto done;
    }
    ret = dev == TAGC_DEV_CUDA ? tagc_py_none_result() : tagc_py_float_result(out, has_out, tau);
done:
    tagc_py_views_release(&vs_);
    return ret;
}

static int check_bits(const char *fn, int64_t bits)
{
    if (bits != 1 && bits != 2 && bits != 4 && bits != 8) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'bits' must be 1, 2, 4 or 8, got %lld",
                     fn, (long long)bits);
        return -1;
    }
    return 0;
}

/* lanes_pack and lanes_unpack: same checks, arguments in mirrored order. */
static PyObject *lanes_common(PyObject *m, PyObject *args, PyObject *kw, int unpack)
{
    static char *kw_pack[] = {"lanes", "bitmap", "n", "bits", "stream", NULL};
    static char *kw_unpack[] = {"bitmap", "lanes", "n", "bits", "stream", NULL};
    PyObject *o1, *o2, *on, *obits, *ostream = NULL;
    TAGC_BEGIN("lanes_pack");
    if (unpack)
        vs_.fn = fn = "_tagc.lanes_unpack";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$O", unpack ? kw_unpack : kw_pack,
                                     &o1, &o2, &on, &obits, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(first, o1, unpack ? "bitmap" : "lanes", TAGC_K_U8);
    TAGC_TAKE(second, o2, unpack ? "lanes" : "bitmap", TAGC_K_U8);
    tagc_py_view *lanes = unpack ? second : first, *bitmap = unpack ? first : second;
    int64_t n, bits;
    TAGC_CHECK(tagc_py_arg_range(fn, on, "n", 0, TAGC_MAX_N, &n));
    TAGC_CHECK(tagc_py_arg_i64(fn, obits, "bits", &bits));
    TAGC_CHECK(check_bits(fn, bits));
    TAGC_CHECK(tagc_py_need_size(&vs_, bitmap, tagc_bitmap_bytes(n), 0, "bitmap_bytes(n)"));
    TAGC_CHECK(tagc_py_need_size(&vs_, lanes, tagc_lanes_bytes(n, (int)bits), 0,
                                 "lanes_bytes(n, bits)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    if (unpack)
        TAGC_RUN_BOTH(dev, bitmap, 0, lanes_unpack,
                      (bitmap->data, bitmap->numel, lanes->data, lanes->numel, n, (int)bits),
                      strm_);
    else
        TAGC_RUN_BOTH(dev, bitmap, 0, lanes_pack,
                      (lanes->data, lanes->numel, bitmap->data, n, (int)bits), strm_);
    TAGC_END_NONE(TAGC_OK, NULL);
}

static PyObject *py_lanes_pack(PyObject *m, PyObject *args, PyObject *kw)
{
    return lanes_common(m, args, kw, 0);
}

static PyObject *py_lanes_unpack(PyObject *m, PyObject *args, PyObject *kw)
{
    return lanes_common(m, args, kw, 1);
}

static PyObject *py_bitmap_or(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"dst", "src", "count", "stream", NULL};
    PyObject *odst, *osrc, *ocount, *ostream = NULL;
    TAGC_BEGIN("bitmap_or");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$O", kwl, &odst, &osrc, &ocount,
                                     &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(dst, odst, "dst", TAGC_K_U8);
    TAGC_TAKE(src, osrc, "src", TAGC_K_U8);
    int64_t count;
    TAGC_CHECK(tagc_py_arg_range(fn, ocount, "count", 1, INT64_MAX, &count));
    if (src->numel % count != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument 'src' has %lld elements, not a multiple of count=%lld",
                     fn, (long long)src->numel, (long long)count);
        goto done;
    }
    int64_t nbytes = src->numel / count;
    TAGC_CHECK(tagc_py_need_size(&vs_, dst, nbytes, 0, "src.numel() // count"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_RUN_BOTH(dev, dst, 0, bitmap_or,
                  (dst->data, dst->numel, src->data, nbytes, count), strm_);
    TAGC_END_NONE(TAGC_OK, NULL);
}

static PyObject *py_popcount(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"bitmap", "n", "out", "stream", NULL};
    PyObject *obm, *on, *oout = NULL, *ostream = NULL;
    TAGC_BEGIN("popcount");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OO", kwl, &obm, &on, &oout, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(bitmap, obm, "bitmap", TAGC_K_U8);
    TAGC_TAKE_OPT(out, has_out, oout, "out", TAGC_K_I64);
    int64_t n, count = 0;
    TAGC_CHECK(tagc_py_arg_range(fn, on, "n", 0, TAGC_MAX_N, &n));
    TAGC_CHECK(tagc_py_need_size(&vs_, bitmap, tagc_bitmap_bytes(n), 0, "bitmap_bytes(n)"));
    TAGC_CHECK(tagc_py_scalar_out_ok(&vs_, out, has_out));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_CHECK(tagc_py_cuda_needs(fn, dev, has_out, "out"));
    if (dev == TAGC_DEV_CUDA) {
        TAGC_RUN_CUDA(bitmap, 0, tagc_cuda_popcount(out->data, bitmap->data, n, strm_));
    } else {
        TAGC_RUN(tagc_popcount(&count, bitmap->data, n));
    }
    if (st != TAGC_OK) {
        tagc_py_raise_status(m, fn, st, NULL);
        goto done;
    }
    ret = dev == TAGC_DEV_CUDA ? tagc_py_none_result() : tagc_py_int_result(out, has_out, count);
done:
    tagc_py_views_release(&vs_);
    return ret;
}

#define T_MAX (((int64_t)1 << 32) - 1)

static PyObject *py_sketch_encode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"sketch", "idx", "val", "n", "t", "seed", "stream",
                          "status_out", NULL};
    PyObject *osk, *oidx, *oval, *on, *ot, *oseed, *ostream = NULL, *ostatus = NULL;
    TAGC_BEGIN("sketch_encode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|$OO", kwl, &osk, &oidx, &oval, &on,
                                     &ot, &oseed, &ostream, &ostatus))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(sk, osk, "sketch", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(idx, oidx, "idx", TAGC_K_I32);
    TAGC_TAKE(val, oval, "val", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE_STATUS(ostatus);
    int64_t n, t;
    uint64_t seed;
    TAGC_CHECK(tagc_py_arg_range(fn, on, "n", 0, TAGC_MAX_N, &n));
    TAGC_CHECK(tagc_py_arg_range(fn, ot, "t", 1, T_MAX, &t));
    TAGC_CHECK(tagc_py_arg_u64(fn, oseed, "seed", &seed));
    TAGC_CHECK(tagc_py_need_size(&vs_, val, idx->numel, 1, "idx.numel()"));
    TAGC_CHECK(tagc_py_need_size(&vs_, sk, tagc_sketch_buckets(t), 0, "sketch_buckets(t)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    /* CUDA: an idx outside [0, n): skipped, RANGE in status_out */
    TAGC_RUN_BOTH(dev, sk, tagc_cuda_sketch_encode_workspace_size(t, tagc_py_codec_dtype(sk->kind)),
                  sketch_encode,
                  (sk->data, tagc_py_codec_dtype(sk->kind), sk->numel, idx->data, val->data,
                   tagc_py_codec_dtype(val->kind), idx->numel, n, t, seed),
                  has_status ? status->data : NULL, ws_, wsb_, strm_);
    TAGC_END_NONE(TAGC_ERR_RANGE,
                  "idx holds a position outside [0, n)");
}

static PyObject *py_peel_decode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "sketch", "bitmap", "n", "t", "seed", "unpeeled",
                          "estimate", "count_out", "stream", NULL};
    PyObject *oout, *osk, *obm, *on, *ot, *oseed, *ounp = NULL, *oest = NULL,
             *ocnt = NULL, *ostream = NULL;
    TAGC_BEGIN("peel_decode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|$OOOO", kwl, &oout, &osk, &obm,
                                     &on, &ot, &oseed, &ounp, &oest, &ocnt, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(out, oout, "out", TAGC_K_F32);
    TAGC_TAKE(sk, osk, "sketch", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(bitmap, obm, "bitmap", TAGC_K_U8);
    TAGC_TAKE_OPT(unp, has_unp, ounp, "unpeeled", TAGC_K_I32);
    TAGC_TAKE_OPT(cnt, has_cnt, ocnt, "count_out", TAGC_K_I64);
    int64_t n, t;
    uint64_t seed;
    int estimate = 1;
    TAGC_CHECK(tagc_py_arg_range(fn, on, "n", 0, TAGC_MAX_N, &n));
    TAGC_CHECK(tagc_py_arg_range(fn, ot, "t", 1, T_MAX, &t));
    TAGC_CHECK(tagc_py_arg_u64(fn, oseed, "seed", &seed));
    if (oest != NULL && (estimate = PyObject_IsTrue(oest)) < 0)
        goto done;
    TAGC_CHECK(tagc_py_need_size(&vs_, out, n, 0, "n"));
    TAGC_CHECK(tagc_py_need_size(&vs_, sk, tagc_sketch_buckets(t), 0, "sketch_buckets(t)"));
    TAGC_CHECK(tagc_py_need_size(&vs_, bitmap, tagc_bitmap_bytes(n), 0, "bitmap_bytes(n)"));
    TAGC_CHECK(tagc_py_scalar_out_ok(&vs_, cnt, has_cnt));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_CHECK(tagc_py_cuda_needs(fn, dev, has_cnt, "count_out"));
    int64_t left = 0;
    if (dev == TAGC_DEV_CUDA) {
        TAGC_RUN_CUDA(out, tagc_cuda_peel_decode_workspace_size(n, t, TAGC_CUDA_PEEL_ROUNDS),
                      tagc_cuda_peel_decode(out->data, out->numel, has_unp ? unp->data : NULL,
                                            has_unp ? unp->numel : 0, cnt->data, sk->data,
                                            tagc_py_codec_dtype(sk->kind), bitmap->data, n, t,
                                            seed, estimate, TAGC_CUDA_PEEL_ROUNDS, ws_, wsb_,
                                            strm_));
    } else {
        TAGC_RUN(tagc_peel_decode(out->data, out->numel, has_unp ? unp->data : NULL,
                                  has_unp ? unp->numel : 0, &left, sk->data,
                                  tagc_py_codec_dtype(sk->kind), bitmap->data, n, t, seed,
                                  estimate));
    }
    if (st != TAGC_OK) {
        tagc_py_raise_status(m, fn, st, NULL);
        goto done;
    }
    ret = dev == TAGC_DEV_CUDA ? tagc_py_none_result() : tagc_py_int_result(cnt, has_cnt, left);
done:
    tagc_py_views_release(&vs_);
    return ret;
}

static PyObject *py_sparse_pack(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"buf", "idx", "val", "stream", NULL};
    PyObject *obuf, *oidx, *oval, *ostream = NULL;
    TAGC_BEGIN("sparse_pack");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$O", kwl, &obuf, &oidx, &oval, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE(idx, oidx, "idx", TAGC_K_I32);
    TAGC_TAKE(val, oval, "val", TAGC_K_F32 | TAGC_K_BF16);
    int64_t k = idx->numel;
    tagc_dtype vd = tagc_py_codec_dtype(val->kind);
    TAGC_CHECK(tagc_py_need_size(&vs_, val, k, 1, "idx.numel()"));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_sparse_bytes(k, vd), 0,
                                 "sparse_bytes(k, value_dtype)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_RUN_BOTH(dev, buf, 0, sparse_pack,
                  (buf->data, buf->numel, idx->data, val->data, vd, k), strm_);
    TAGC_END_NONE(TAGC_OK, NULL);
}

static PyObject *py_sparse_unpack(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "buf", "k", "value_dtype", "stream", "status_out", NULL};
    PyObject *oout, *obuf, *ok, *odt, *ostream = NULL, *ostatus = NULL;
    TAGC_BEGIN("sparse_unpack");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$OO", kwl, &oout, &obuf, &ok, &odt,
                                     &ostream, &ostatus))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(out, oout, "out", TAGC_K_F32);
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE_STATUS(ostatus);
    int64_t k;
    tagc_dtype vd;
    TAGC_CHECK(tagc_py_arg_value_dtype(fn, odt, &vd));
    TAGC_CHECK(tagc_py_arg_range(fn, ok, "k", 0, INT64_MAX / 8, &k));
    TAGC_CHECK(tagc_py_need_max_n(&vs_, out));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_sparse_bytes(k, vd), 1,
                                 "sparse_bytes(k, value_dtype)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    /* CUDA: bad offset: out untouched, CORRUPT in status_out */
    TAGC_RUN_BOTH(dev, out, tagc_cuda_sparse_unpack_workspace_size(), sparse_unpack,
                  (out->data, out->numel, buf->data, buf->numel, k, vd),
                  has_status ? status->data : NULL, ws_, wsb_, strm_);
    TAGC_END_NONE(TAGC_ERR_CORRUPT,
                  "buf holds an offset outside [0, out.numel()) "
                  "(out untouched)");
}

/* A string argument naming one value of a C enum. */
typedef struct {
    const char *name;
    int value;
} enum_name;

static const enum_name QFORMAT_NAMES[] = {
    {"sign", TAGC_Q_SIGN}, {"ternary", TAGC_Q_TERNARY}, {"int4", TAGC_Q_INT4},
    {"int8", TAGC_Q_INT8}, {NULL, 0}};
/* The weight gather (wq_*) codes int4 and int8 only. */
static const enum_name WQ_FORMAT_NAMES[] = {{"int4", TAGC_Q_INT4}, {"int8", TAGC_Q_INT8},
                                            {NULL, 0}};
static const enum_name CODING_NAMES[] = {
    {"ef", TAGC_PAIRS_EF}, {"bitmap", TAGC_PAIRS_BITMAP}, {"dense", TAGC_PAIRS_DENSE},
    {NULL, 0}};

/* *out = the value named by o; ValueError listing `choices` otherwise. */
static int arg_enum(const char *fn, PyObject *o, const char *arg, const enum_name *names,
                    const char *choices, int *out)
{
    const char *c = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
    if (c == NULL && PyErr_Occurred())
        return -1;
    for (const enum_name *e = names; c != NULL && e->name != NULL; e++) {
        if (!strcmp(c, e->name)) {
            *out = e->value;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be %s, got %R", fn, arg, choices, o);
    return -1;
}

/* A format argument: any quant format, or (wq = 1) the two wq_* codes. */
static int arg_format(const char *fn, PyObject *o, int wq, tagc_qformat *out)
{
    int v;
    if (arg_enum(fn, o, "format", wq ? WQ_FORMAT_NAMES : QFORMAT_NAMES,
                 wq ? "'int4' or 'int8'" : "'sign', 'ternary', 'int4' or 'int8'", &v) < 0)
        return -1;
    *out = (tagc_qformat)v;
    return 0;
}

static int arg_coding(const char *fn, PyObject *o, tagc_coding *out)
{
    int v;
    if (arg_enum(fn, o, "coding", CODING_NAMES, "'ef', 'bitmap' or 'dense'", &v) < 0)
        return -1;
    *out = (tagc_coding)v;
    return 0;
}

/* The (format, block) pair every quant_* (wq = 0) and wq_* (wq = 1)
 * function takes. */
static int arg_quant(const char *fn, PyObject *ofmt, PyObject *oblock, int wq,
                     tagc_qformat *fmt, int64_t *block)
{
    if (arg_format(fn, ofmt, wq, fmt) < 0)
        return -1;
    return tagc_py_arg_range(fn, oblock, "block", 1, TAGC_QBLOCK_MAX, block);
}

static PyObject *py_pairs_pack(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"buf", "idx", "val", "n", "coding", "stream", "status_out", NULL};
    PyObject *obuf, *oidx, *oval, *on, *oc, *ostream = NULL, *ostatus = NULL;
    TAGC_BEGIN("pairs_pack");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$OO", kwl, &obuf, &oidx, &oval, &on,
                                     &oc, &ostream, &ostatus))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE(idx, oidx, "idx", TAGC_K_I32);
    TAGC_TAKE(val, oval, "val", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE_STATUS(ostatus);
    int64_t n, k = idx->numel;
    tagc_coding c;
    tagc_dtype vd = tagc_py_codec_dtype(val->kind);
    TAGC_CHECK(tagc_py_arg_range(fn, on, "n", k, TAGC_MAX_N, &n));
    TAGC_CHECK(arg_coding(fn, oc, &c));
    TAGC_CHECK(tagc_py_need_size(&vs_, val, k, 1, "idx.numel()"));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_pairs_bytes(n, k, vd, c), 0,
                                 "pairs_bytes(n, k, value_dtype, coding)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    /* CUDA: positions not ascending in [0, n): RANGE in status_out */
    TAGC_RUN_BOTH(dev, buf, tagc_cuda_pairs_pack_workspace_size(), pairs_pack,
                  (buf->data, buf->numel, idx->data, val->data, vd, k, n, c),
                  has_status ? status->data : NULL, ws_, wsb_, strm_);
    TAGC_END_NONE(TAGC_ERR_RANGE,
                  "idx must be strictly ascending "
                  "positions in [0, n) (nothing written)");
}

static PyObject *py_pairs_unpack_add(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "buf", "k", "value_dtype", "coding", "stream", "status_out",
                          NULL};
    PyObject *oout, *obuf, *ok, *odt, *oc, *ostream = NULL, *ostatus = NULL;
    TAGC_BEGIN("pairs_unpack_add");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$OO", kwl, &oout, &obuf, &ok, &odt,
                                     &oc, &ostream, &ostatus))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(out, oout, "out", TAGC_K_F32);
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE_STATUS(ostatus);
    int64_t k;
    tagc_dtype vd;
    tagc_coding c;
    TAGC_CHECK(tagc_py_need_max_n(&vs_, out));
    TAGC_CHECK(tagc_py_arg_range(fn, ok, "k", 0, out->numel, &k));
    TAGC_CHECK(tagc_py_arg_value_dtype(fn, odt, &vd));
    TAGC_CHECK(arg_coding(fn, oc, &c));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_pairs_bytes(out->numel, k, vd, c), 1,
                                 "pairs_bytes(out.numel(), k, value_dtype, coding)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    /* CUDA: inconsistent message: out untouched, CORRUPT in status_out */
    TAGC_RUN_BOTH(dev, out, tagc_cuda_pairs_unpack_add_workspace_size(out->numel, k),
                  pairs_unpack_add, (out->data, out->numel, buf->data, buf->numel, k, vd, c),
                  has_status ? status->data : NULL, ws_, wsb_, strm_);
    TAGC_END_NONE(TAGC_ERR_CORRUPT,
                  "buf is not a valid message of k pairs of a "
                  "shard of out.numel() (out untouched)");
}

static PyObject *py_quant_encode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"buf", "residual", "grad", "format", "block", "stream", NULL};
    PyObject *obuf, *ores, *ograd, *ofmt, *oblock, *ostream = NULL;
    TAGC_BEGIN("quant_encode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$O", kwl, &obuf, &ores, &ograd, &ofmt,
                                     &oblock, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    tagc_qformat fmt;
    int64_t block;
    TAGC_CHECK(arg_quant(fn, ofmt, oblock, 0, &fmt, &block));
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE_OPT(res, has_res, ores, "residual", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(grad, ograd, "grad", TAGC_K_F32 | TAGC_K_BF16);
    int64_t n = grad->numel;
    TAGC_CHECK(tagc_py_need_max_n(&vs_, grad));
    if (has_res)
        TAGC_CHECK(tagc_py_need_size(&vs_, res, n, 1, "grad.numel()"));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_quant_bytes(n, fmt, block), 0,
                                 "quant_bytes(grad.numel(), format, block)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    /* CUDA: NaN/Inf: every scale NaN, residual untouched (tagc_cuda.h) */
    TAGC_RUN_BOTH(dev, grad, tagc_cuda_quant_encode_workspace_size(), quant_encode,
                  (buf->data, buf->numel, has_res ? res->data : NULL,
                   tagc_py_codec_dtype(res->kind), grad->data, tagc_py_codec_dtype(grad->kind),
                   n, fmt, block),
                  ws_, wsb_, strm_);
    TAGC_END_NONE(TAGC_ERR_NONFINITE,
                  "grad + residual holds NaN or Inf (residual "
                  "untouched)");
}

static PyObject *py_quant_decode_add(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "buf", "format", "block", "stream", "status_out", NULL};
    PyObject *oout, *obuf, *ofmt, *oblock, *ostream = NULL, *ostatus = NULL;
    TAGC_BEGIN("quant_decode_add");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$OO", kwl, &oout, &obuf, &ofmt, &oblock,
                                     &ostream, &ostatus))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    tagc_qformat fmt;
    int64_t block;
    TAGC_CHECK(arg_quant(fn, ofmt, oblock, 0, &fmt, &block));
    TAGC_TAKE(out, oout, "out", TAGC_K_F32);
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE_STATUS(ostatus);
    TAGC_CHECK(tagc_py_need_max_n(&vs_, out));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_quant_bytes(out->numel, fmt, block), 1,
                                 "quant_bytes(out.numel(), format, block)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    /* CUDA: invalid code: out untouched, CORRUPT in status_out */
    TAGC_RUN_BOTH(dev, out, tagc_cuda_quant_decode_add_workspace_size(), quant_decode_add,
                  (out->data, out->numel, buf->data, buf->numel, fmt, block),
                  has_status ? status->data : NULL, ws_, wsb_, strm_);
    TAGC_END_NONE(TAGC_ERR_CORRUPT,
                  "buf holds a code outside the format "
                  "(out untouched)");
}

/* ---- one unit at a time: the quant transport with a coded residual ----- */

/* world in [1, TAGC_MAX_N], rank in [0, world), and grad.numel() split into
 * world shards: the shard's length in *shard. */
static int arg_unit(const char *fn, PyObject *oworld, PyObject *orank, int64_t numel,
                    int64_t *world, int64_t *rank, int64_t *shard)
{
    if (tagc_py_arg_range(fn, oworld, "world", 1, TAGC_MAX_N, world) < 0 ||
        tagc_py_arg_range(fn, orank, "rank", 0, *world - 1, rank) < 0)
        return -1;
    if (numel % *world != 0) {
        PyErr_Format(PyExc_ValueError, "%s: %lld values do not split into world = %lld shards",
                     fn, (long long)numel, (long long)*world);
        return -1;
    }
    *shard = numel / *world;
    return 0;
}

static PyObject *py_quant_unit_encode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"buf", "rcodes", "grad", "world", "rank", "format",
                          "residual_format", "block", "factor", "counts", "vote", "flags",
                          "stream", NULL};
    PyObject *obuf, *orc, *ograd, *oworld, *orank, *ofmt, *orfmt, *oblock;
    PyObject *ocounts = NULL, *ovote = NULL, *oflags = NULL, *ostream = NULL;
    double factor;
    TAGC_BEGIN("quant_unit_encode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOd|$OOOO", kwl, &obuf, &orc, &ograd,
                                     &oworld, &orank, &ofmt, &orfmt, &oblock, &factor,
                                     &ocounts, &ovote, &oflags, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    tagc_qformat fmt, rfmt;
    int64_t block, world, rank, shard;
    int v;
    TAGC_CHECK(arg_quant(fn, ofmt, oblock, 0, &fmt, &block));
    TAGC_CHECK(arg_enum(fn, orfmt, "residual_format", QFORMAT_NAMES,
                        "'sign', 'ternary', 'int4' or 'int8'", &v));
    rfmt = (tagc_qformat)v;
    if (!(factor >= 0.0 && factor <= 1.0)) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'factor' must be in [0, 1], got %g", fn,
                     factor);
        goto done;
    }
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE(rc, orc, "rcodes", TAGC_K_U8);
    TAGC_TAKE(grad, ograd, "grad", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE_OPT(counts, has_counts, ocounts, "counts", TAGC_K_I64);
    TAGC_TAKE_OPT(vote, has_vote, ovote, "vote", TAGC_K_F32);
    TAGC_TAKE_OPT(flags, has_flags, oflags, "flags", TAGC_K_I32);
    TAGC_CHECK(tagc_py_need_max_n(&vs_, grad));
    TAGC_CHECK(arg_unit(fn, oworld, orank, grad->numel, &world, &rank, &shard));
    if (shard % block != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: the shard of %lld values is not a whole number of blocks of %lld "
                     "(a residual record would straddle two shards)",
                     fn, (long long)shard, (long long)block);
        goto done;
    }
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, world * tagc_quant_bytes(shard, fmt, block), 0,
                                 "world * quant_bytes(grad.numel() // world, format, block)"));
    TAGC_CHECK(tagc_py_need_size(&vs_, rc, tagc_quant_bytes(grad->numel, rfmt, block), 1,
                                 "quant_bytes(grad.numel(), residual_format, block)"));
    TAGC_CHECK(tagc_py_scalar_out_ok(&vs_, vote, has_vote));
    if (has_counts)
        TAGC_CHECK(tagc_py_need_size(&vs_, counts, 5, 1,
                                     "5 (encoded, poisoned, reset, union size, shard slots)"));
    if (has_flags)
        TAGC_CHECK(tagc_py_need_size(&vs_, flags, 2, 1, "2 (the guard's flag and a count)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_CHECK(tagc_py_cuda_needs(fn, dev, has_counts, "counts"));
    TAGC_CHECK(tagc_py_cuda_needs(fn, dev, has_flags, "flags"));
    if (dev == TAGC_DEV_CPU && (has_counts || has_vote || has_flags)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: counts, vote and flags are for CUDA tensors (on the CPU a non-finite "
                     "value raises and the reset is returned)", fn);
        goto done;
    }
    int reset_here = 0;
    if (dev == TAGC_DEV_CUDA) {
        TAGC_RUN_CUDA(grad, 0, tagc_cuda_quant_unit_encode(
                                   buf->data, buf->numel, rc->data, rc->numel, grad->data,
                                   tagc_py_codec_dtype(grad->kind), shard, world, rank, fmt,
                                   rfmt, block, (float)factor, counts->data, vote->data,
                                   flags->data, strm_));
    } else {
        TAGC_RUN(tagc_quant_unit_encode(buf->data, buf->numel, rc->data, rc->numel, grad->data,
                                        tagc_py_codec_dtype(grad->kind), shard, world, rank,
                                        fmt, rfmt, block, (float)factor, &reset_here));
    }
    if (st != TAGC_OK) {
        tagc_py_raise_status(m, fn, st,
                             st == TAGC_ERR_NONFINITE
                                 ? "grad + residual holds NaN or Inf (rcodes untouched)"
                             : st == TAGC_ERR_CORRUPT
                                 ? "rcodes holds a code outside residual_format "
                                   "(rcodes untouched)"
                                 : NULL);
        goto done;
    }
    ret = dev == TAGC_DEV_CUDA ? tagc_py_none_result() : PyLong_FromLong(reset_here);
done:
    tagc_py_views_release(&vs_);
    return ret;
}

static PyObject *py_quant_unit_decode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "buf", "own", "world", "rank", "format", "block", "divisor",
                          "stream", NULL};
    PyObject *oout, *obuf, *oown, *oworld, *orank, *ofmt, *oblock, *ostream = NULL;
    double divisor;
    TAGC_BEGIN("quant_unit_decode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOd|$O", kwl, &oout, &obuf, &oown,
                                     &oworld, &orank, &ofmt, &oblock, &divisor, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    tagc_qformat fmt;
    int64_t block, world, rank, shard;
    TAGC_CHECK(arg_quant(fn, ofmt, oblock, 0, &fmt, &block));
    if (!(fabs(divisor) <= FLT_MAX) || (float)divisor == 0.0f) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument 'divisor' must be finite and nonzero in float32, got %g",
                     fn, divisor);
        goto done;
    }
    TAGC_TAKE(out, oout, "out", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE(own, oown, "own", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_CHECK(tagc_py_need_max_n(&vs_, out));
    TAGC_CHECK(tagc_py_arg_range(fn, oworld, "world", 1, TAGC_MAX_N, &world));
    TAGC_CHECK(tagc_py_arg_range(fn, orank, "rank", 0, world - 1, &rank));
    shard = out->numel;
    TAGC_CHECK(tagc_py_need_size(&vs_, own, shard, 1, "out.numel()"));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, world * tagc_quant_bytes(shard, fmt, block), 1,
                                 "world * quant_bytes(out.numel(), format, block)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    /* CUDA: a code outside the format decodes to NaN (tagc_cuda.h) */
    TAGC_RUN_BOTH(dev, out, 0, quant_unit_decode,
                  (out->data, tagc_py_codec_dtype(out->kind), shard, buf->data, buf->numel,
                   own->data, tagc_py_codec_dtype(own->kind), world, rank, fmt, block,
                   (float)divisor),
                  strm_);
    TAGC_END_NONE(TAGC_ERR_CORRUPT,
                  "a row of buf holds a code outside the format (out untouched)");
}

/* ---- 4-bit codes (fp4) and the block rotation ---------------------------- */

/* block: a power of two in [2, TAGC_FP4_BLOCK_MAX]. */
static int arg_fp4_block(const char *fn, PyObject *o, int64_t *block)
{
    if (tagc_py_arg_range(fn, o, "block", 2, TAGC_FP4_BLOCK_MAX, block) < 0)
        return -1;
    if ((*block & (*block - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'block' must be a power of two, got %lld",
                     fn, (long long)*block);
        return -1;
    }
    return 0;
}

/* seed (uint64) and the flags of the keyword booleans. */
static int arg_fp4_flags(const char *fn, PyObject *oseed, int rotate, int stochastic,
                         uint64_t *seed, unsigned *flags)
{
    *flags = (rotate ? TAGC_FP4_ROTATE : 0u) | (stochastic ? TAGC_FP4_STOCHASTIC : 0u);
    *seed = 0;
    return oseed == NULL ? 0 : tagc_py_arg_u64(fn, oseed, "seed", seed);
}

static PyObject *py_fp4_encode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"buf", "residual", "grad", "block", "seed", "rotate", "stochastic",
                          "stream", NULL};
    PyObject *obuf, *ores, *ograd, *oblock, *oseed = NULL, *ostream = NULL;
    int rotate = 0, stochastic = 0;
    TAGC_BEGIN("fp4_encode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$OppO", kwl, &obuf, &ores, &ograd, &oblock,
                                     &oseed, &rotate, &stochastic, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    int64_t block;
    uint64_t seed;
    unsigned flags;
    TAGC_CHECK(arg_fp4_block(fn, oblock, &block));
    TAGC_CHECK(arg_fp4_flags(fn, oseed, rotate, stochastic, &seed, &flags));
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE_OPT(res, has_res, ores, "residual", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(grad, ograd, "grad", TAGC_K_F32 | TAGC_K_BF16);
    int64_t n = grad->numel;
    TAGC_CHECK(tagc_py_need_max_n(&vs_, grad));
    if (has_res)
        TAGC_CHECK(tagc_py_need_size(&vs_, res, n, 1, "grad.numel()"));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_fp4_bytes(n, block), 0,
                                 "fp4_bytes(grad.numel(), block)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    /* CUDA: NaN/Inf: every scale byte NaN, residual untouched */
    TAGC_RUN_BOTH(dev, grad, tagc_cuda_fp4_encode_workspace_size(), fp4_encode,
                  (buf->data, buf->numel, has_res ? res->data : NULL,
                   tagc_py_codec_dtype(res->kind), grad->data, tagc_py_codec_dtype(grad->kind),
                   n, block, flags, seed),
                  ws_, wsb_, strm_);
    TAGC_END_NONE(TAGC_ERR_NONFINITE,
                  "grad + residual holds NaN, Inf or a |v| >= 2^100 (residual untouched)");
}

static PyObject *py_fp4_decode_add(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "buf", "block", "seed", "rotate", "stream", NULL};
    PyObject *oout, *obuf, *oblock, *oseed = NULL, *ostream = NULL;
    int rotate = 0;
    TAGC_BEGIN("fp4_decode_add");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$OpO", kwl, &oout, &obuf, &oblock, &oseed,
                                     &rotate, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    int64_t block;
    uint64_t seed;
    unsigned flags;
    TAGC_CHECK(arg_fp4_block(fn, oblock, &block));
    TAGC_CHECK(arg_fp4_flags(fn, oseed, rotate, 0, &seed, &flags));
    TAGC_TAKE(out, oout, "out", TAGC_K_F32);
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_CHECK(tagc_py_need_max_n(&vs_, out));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_fp4_bytes(out->numel, block), 1,
                                 "fp4_bytes(out.numel(), block)"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_RUN_BOTH(dev, out, 0, fp4_decode_add,
                  (out->data, out->numel, buf->data, buf->numel, block, flags, seed), strm_);
    TAGC_END_NONE(TAGC_OK, NULL);
}

/* ---- ternary codes with two-level log scales (tls) ------------------------ */

static PyObject *py_tls_encode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"buf", "residual", "grad", "stream", NULL};
    PyObject *obuf, *ores, *ograd, *ostream = NULL;
    TAGC_BEGIN("tls_encode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$O", kwl, &obuf, &ores, &ograd, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE_OPT(res, has_res, ores, "residual", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(grad, ograd, "grad", TAGC_K_F32 | TAGC_K_BF16);
    int64_t n = grad->numel;
    TAGC_CHECK(tagc_py_need_max_n(&vs_, grad));
    if (has_res)
        TAGC_CHECK(tagc_py_need_size(&vs_, res, n, 1, "grad.numel()"));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_tls_bytes(n), 0, "tls_bytes(grad.numel())"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    /* CUDA: NaN/Inf: a NaN message scale, residual untouched */
    TAGC_RUN_BOTH(dev, grad, tagc_cuda_tls_encode_workspace_size(n), tls_encode,
                  (buf->data, buf->numel, has_res ? res->data : NULL,
                   tagc_py_codec_dtype(res->kind), grad->data, tagc_py_codec_dtype(grad->kind),
                   n),
                  ws_, wsb_, strm_);
    TAGC_END_NONE(TAGC_ERR_NONFINITE, "grad + residual holds NaN or Inf (residual untouched)");
}

static PyObject *py_tls_decode_add(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "buf", "stream", "status_out", NULL};
    PyObject *oout, *obuf, *ostream = NULL, *ostatus = NULL;
    TAGC_BEGIN("tls_decode_add");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OO", kwl, &oout, &obuf, &ostream,
                                     &ostatus))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    TAGC_TAKE(out, oout, "out", TAGC_K_F32);
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE_STATUS(ostatus);
    TAGC_CHECK(tagc_py_need_max_n(&vs_, out));
    TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_tls_bytes(out->numel), 1,
                                 "tls_bytes(out.numel())"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    /* CUDA: an invalid message: out untouched, CORRUPT in status_out */
    TAGC_RUN_BOTH(dev, out, tagc_cuda_tls_decode_add_workspace_size(), tls_decode_add,
                  (out->data, out->numel, buf->data, buf->numel),
                  has_status ? status->data : NULL, ws_, wsb_, strm_);
    TAGC_END_NONE(TAGC_ERR_CORRUPT,
                  "buf holds a code byte >= 243 or a negative, -0 or infinite message scale "
                  "(out untouched)");
}

static PyObject *py_rht(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"dst", "src", "block", "seed", "inverse", "stream", NULL};
    PyObject *odst, *osrc, *oblock, *oseed, *ostream = NULL;
    int inverse = 0;
    TAGC_BEGIN("rht");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$pO", kwl, &odst, &osrc, &oblock, &oseed,
                                     &inverse, &ostream))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    int64_t block;
    uint64_t seed;
    TAGC_CHECK(arg_fp4_block(fn, oblock, &block));
    TAGC_CHECK(tagc_py_arg_u64(fn, oseed, "seed", &seed));
    TAGC_TAKE(dst, odst, "dst", TAGC_K_F32);
    TAGC_TAKE(src, osrc, "src", TAGC_K_F32);
    TAGC_CHECK(tagc_py_need_max_n(&vs_, src));
    TAGC_CHECK(tagc_py_need_size(&vs_, dst, src->numel, 1, "src.numel()"));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_RUN_BOTH(dev, src, 0, rht,
                  (dst->data, dst->numel, src->data, src->numel, block, seed, inverse), strm_);
    TAGC_END_NONE(TAGC_OK, NULL);
}

/* ---- quantized weight gather ------------------------------------------- */

/* The segment lengths of a wq call: an int64 tensor (a view, on the data's
 * device: the CUDA kernels read it there) or a sequence of ints (copied into
 * vs->owned, CPU calls only; view is NULL then). */
typedef struct {
    const int64_t *len;
    int64_t n;
    tagc_py_view *view;
} segs_t;

static int arg_segs(tagc_py_views *vs, PyObject *o, segs_t *segs)
{
    memset(segs, 0, sizeof *segs);
    if (PyObject_HasAttrString(o, "__dlpack__")) {
        segs->view = tagc_py_view_take(vs, o, "segs", TAGC_K_I64);
        if (segs->view == NULL)
            return -1;
        segs->len = segs->view->data;
        segs->n = segs->view->numel;
        return 0;
    }
    /* A tuple copy: an element's __index__ cannot resize what is iterated. */
    PyObject *seq = PySequence_Tuple(o);
    if (seq == NULL) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument 'segs' must be a sequence of ints or an int64 tensor, "
                     "not %.100s", vs->fn, Py_TYPE(o)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    vs->owned = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (vs->owned == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (tagc_py_arg_i64(vs->fn, PyTuple_GET_ITEM(seq, i), "segs", &vs->owned[i]) < 0) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    segs->len = vs->owned;
    segs->n = n;
    return 0;
}

/* Host-side check of a table the CPU op will read: every length in
 * [0, 2**31-1], their sum too (*total). */
static int segs_check(tagc_py_views *vs, const segs_t *segs, int64_t *total)
{
    *total = 0;
    if (segs->n > TAGC_MAX_N) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'segs' has more than 2**31-1 segments",
                     vs->fn);
        return -1;
    }
    for (int64_t i = 0; i < segs->n; i++) {
        if (segs->len[i] < 0 || segs->len[i] > TAGC_MAX_N - *total) {
            PyErr_Format(PyExc_ValueError,
                         "%s: argument 'segs': segment %lld has length %lld (lengths must "
                         "be >= 0, their sum at most 2**31-1)",
                         vs->fn, (long long)i, (long long)segs->len[i]);
            return -1;
        }
        *total += segs->len[i];
    }
    return 0;
}

/* On CPU: the table checked and summing to n (the data's numel()).  On CUDA:
 * an int64 tensor on the device (the launchers check it there, no sync). */
static int segs_for(tagc_py_views *vs, const segs_t *segs, int dev, const tagc_py_view *data)
{
    int64_t total;
    if (dev == TAGC_DEV_CUDA) {
        if (segs->view == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "%s: argument 'segs' must be an int64 tensor on the data's device "
                         "for CUDA tensors (the kernels read it there)", vs->fn);
            return -1;
        }
        return 0;
    }
    if (segs_check(vs, segs, &total) < 0)
        return -1;
    if (total != data->numel) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument 'segs' sums to %lld, but '%s' has %lld elements",
                     vs->fn, (long long)total, data->name, (long long)data->numel);
        return -1;
    }
    return 0;
}

/* ---- size functions ---------------------------------------------------- */

/* The eight size functions (bitmap_bytes, lanes_bytes, sketch_buckets,
 * sparse_bytes, quant_bytes, pairs_bytes, pairs_cheapest, wq_bytes) take
 * ints, names and at most a segment table, and touch no tensor data: one
 * implementation, size_call(), serves them all from the table SIZE_FNS.  A
 * row is the function's name, the tagc.h rule it binds and the kinds of its
 * arguments in signature order; a kind fixes the keyword and the check,
 * the same check (and message) as the entry points taking that argument. */
typedef enum {
    SA_N,        /* "n": [0, MAX_N] */
    SA_K_OF_N,   /* "k": [0, n], the n checked before it */
    SA_K,        /* "k": [0, INT64_MAX / 8], so that k * 8 cannot overflow */
    SA_BITS,     /* "bits": 1, 2, 4 or 8 */
    SA_T,        /* "t": [1, T_MAX] */
    SA_VDTYPE,   /* "value_dtype": torch.float32 or torch.bfloat16 */
    SA_QFORMAT,  /* "format": any quant format */
    SA_WQFORMAT, /* "format": int4 or int8 */
    SA_BLOCK,    /* "block": [1, QBLOCK_MAX] */
    SA_CODING,   /* "coding": 'ef', 'bitmap' or 'dense' */
    SA_SEGS,     /* "segs": a CPU table, read after every other argument */
    SA_FP4BLOCK, /* "block": a power of two in [2, FP4_BLOCK_MAX] */
} size_arg;

static char *const SIZE_KEYWORDS[] = {
    [SA_N] = "n", [SA_K_OF_N] = "k", [SA_K] = "k", [SA_BITS] = "bits", [SA_T] = "t",
    [SA_VDTYPE] = "value_dtype", [SA_QFORMAT] = "format", [SA_WQFORMAT] = "format",
    [SA_BLOCK] = "block", [SA_CODING] = "coding", [SA_SEGS] = "segs",
    [SA_FP4BLOCK] = "block"};

/* The checked arguments; a rule reads those its row's kinds fill. */
typedef struct {
    int64_t n, k, bits, t, block;
    tagc_dtype vd;
    tagc_qformat fmt;
    tagc_coding coding;
    segs_t segs;
} size_args;

#define SIZE_MAX_ARGS 4

typedef struct {
    const char *fn;
    int64_t (*rule)(const size_args *a);
    int names_coding; /* the result is a tagc_coding, returned by name */
    int nargs;
    size_arg kinds[SIZE_MAX_ARGS];
} size_fn;

/* size_<name>: tagc.h's rule over the checked arguments `a`. */
#define SIZE_RULE(name, expr)                     \
    static int64_t size_##name(const size_args *a) \
    {                                             \
        return (expr);                            \
    }
SIZE_RULE(bitmap_bytes, tagc_bitmap_bytes(a->n))
SIZE_RULE(lanes_bytes, tagc_lanes_bytes(a->n, (int)a->bits))
SIZE_RULE(sketch_buckets, tagc_sketch_buckets(a->t))
SIZE_RULE(sparse_bytes, tagc_sparse_bytes(a->k, a->vd))
SIZE_RULE(quant_bytes, tagc_quant_bytes(a->n, a->fmt, a->block))
SIZE_RULE(pairs_bytes, tagc_pairs_bytes(a->n, a->k, a->vd, a->coding))
SIZE_RULE(pairs_cheapest, (int64_t)tagc_pairs_cheapest(a->n, a->k, a->vd))
SIZE_RULE(wq_bytes, tagc_wq_bytes(a->segs.len, a->segs.n, a->fmt, a->block))
SIZE_RULE(fp4_bytes, tagc_fp4_bytes(a->n, a->block))
SIZE_RULE(tls_bytes, tagc_tls_bytes(a->n))
SIZE_RULE(wq_delta_bytes, tagc_wq_delta_bytes(a->segs.len, a->segs.n, a->fmt, a->block))

enum { SZ_BITMAP, SZ_LANES, SZ_SKETCH, SZ_SPARSE, SZ_QUANT, SZ_PAIRS, SZ_CHEAPEST, SZ_WQ,
       SZ_FP4, SZ_WQ_DELTA, SZ_TLS };

static const size_fn SIZE_FNS[] = {
    [SZ_BITMAP] = {"_tagc.bitmap_bytes", size_bitmap_bytes, 0, 1, {SA_N}},
    [SZ_LANES] = {"_tagc.lanes_bytes", size_lanes_bytes, 0, 2, {SA_N, SA_BITS}},
    [SZ_SKETCH] = {"_tagc.sketch_buckets", size_sketch_buckets, 0, 1, {SA_T}},
    [SZ_SPARSE] = {"_tagc.sparse_bytes", size_sparse_bytes, 0, 2, {SA_K, SA_VDTYPE}},
    [SZ_QUANT] = {"_tagc.quant_bytes", size_quant_bytes, 0, 3,
                  {SA_N, SA_QFORMAT, SA_BLOCK}},
    [SZ_PAIRS] = {"_tagc.pairs_bytes", size_pairs_bytes, 0, 4,
                  {SA_N, SA_K_OF_N, SA_VDTYPE, SA_CODING}},
    [SZ_CHEAPEST] = {"_tagc.pairs_cheapest", size_pairs_cheapest, 1, 3,
                     {SA_N, SA_K_OF_N, SA_VDTYPE}},
    [SZ_WQ] = {"_tagc.wq_bytes", size_wq_bytes, 0, 3, {SA_SEGS, SA_WQFORMAT, SA_BLOCK}},
    [SZ_FP4] = {"_tagc.fp4_bytes", size_fp4_bytes, 0, 2, {SA_N, SA_FP4BLOCK}},
    [SZ_WQ_DELTA] = {"_tagc.wq_delta_bytes", size_wq_delta_bytes, 0, 3,
                     {SA_SEGS, SA_WQFORMAT, SA_BLOCK}},
    [SZ_TLS] = {"_tagc.tls_bytes", size_tls_bytes, 0, 1, {SA_N}},
};

/* Checks one argument of a scalar kind into *a. */
static int size_arg_check(const char *fn, size_arg kind, PyObject *o, size_args *a)
{
    switch (kind) {
    case SA_N: return tagc_py_arg_range(fn, o, "n", 0, TAGC_MAX_N, &a->n);
    case SA_K_OF_N: return tagc_py_arg_range(fn, o, "k", 0, a->n, &a->k);
    case SA_K: return tagc_py_arg_range(fn, o, "k", 0, INT64_MAX / 8, &a->k);
    case SA_BITS:
        return tagc_py_arg_i64(fn, o, "bits", &a->bits) < 0 ? -1 : check_bits(fn, a->bits);
    case SA_T: return tagc_py_arg_range(fn, o, "t", 1, T_MAX, &a->t);
    case SA_VDTYPE: return tagc_py_arg_value_dtype(fn, o, &a->vd);
    case SA_QFORMAT: return arg_format(fn, o, 0, &a->fmt);
    case SA_WQFORMAT: return arg_format(fn, o, 1, &a->fmt);
    case SA_BLOCK: return tagc_py_arg_range(fn, o, "block", 1, TAGC_QBLOCK_MAX, &a->block);
    case SA_CODING: return arg_coding(fn, o, &a->coding);
    case SA_FP4BLOCK: return arg_fp4_block(fn, o, &a->block);
    case SA_SEGS: break; /* size_segs(), once the cheap checks passed */
    }
    return 0;
}

/* wq_bytes' table: the size is a host number, so the table must be on the
 * CPU, where it is checked as the CPU op checks it. */
static int size_segs(tagc_py_views *vs, PyObject *o, segs_t *segs)
{
    int64_t total;
    if (arg_segs(vs, o, segs) < 0)
        return -1;
    int dev = tagc_py_common_device(vs);
    if (dev < 0)
        return -1;
    if (dev == TAGC_DEV_CUDA) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument 'segs' must be on the CPU (the size is a host number)",
                     vs->fn);
        return -1;
    }
    return segs_check(vs, segs, &total);
}

static PyObject *coding_name(PyObject *m, const char *fn, tagc_coding c)
{
    for (const enum_name *e = CODING_NAMES; e->name != NULL; e++)
        if (e->value == (int)c)
            return PyUnicode_FromString(e->name);
    return tagc_py_raise_status(m, fn, TAGC_ERR_RANGE, NULL);
}

/* The one implementation of the size functions: f's arguments, all
 * required, positional or keyword, checked in signature order (a segment
 * table last), then f's rule. */
static PyObject *size_call(PyObject *m, PyObject *args, PyObject *kw, const size_fn *f)
{
    char *kwl[SIZE_MAX_ARGS + 1] = {NULL};
    PyObject *o[SIZE_MAX_ARGS] = {NULL};
    int segs_at = -1;
    for (int i = 0; i < f->nargs; i++) {
        kwl[i] = SIZE_KEYWORDS[f->kinds[i]];
        if (f->kinds[i] == SA_SEGS)
            segs_at = i;
    }
    /* nargs "O"s: the tail of "OOOO" */
    if (!PyArg_ParseTupleAndKeywords(args, kw, &"OOOO"[SIZE_MAX_ARGS - f->nargs], kwl, &o[0],
                                     &o[1], &o[2], &o[3]))
        return NULL;
    tagc_py_views vs;
    memset(&vs, 0, sizeof vs);
    vs.fn = f->fn;
    size_args a;
    memset(&a, 0, sizeof a);
    PyObject *ret = NULL;
    for (int i = 0; i < f->nargs; i++)
        if (size_arg_check(f->fn, f->kinds[i], o[i], &a) < 0)
            goto done;
    if (segs_at >= 0 && size_segs(&vs, o[segs_at], &a.segs) < 0)
        goto done;
    int64_t r = f->rule(&a);
    ret = f->names_coding ? coding_name(m, f->fn, (tagc_coding)r) : PyLong_FromLongLong(r);
done:
    tagc_py_views_release(&vs);
    return ret;
}

/* py_<name>: the entry point of row `row` of SIZE_FNS. */
#define SIZE_ENTRY(name, row)                                                \
    static PyObject *py_##name(PyObject *m, PyObject *args, PyObject *kw)    \
    {                                                                        \
        return size_call(m, args, kw, &SIZE_FNS[row]);                       \
    }
SIZE_ENTRY(bitmap_bytes, SZ_BITMAP)
SIZE_ENTRY(lanes_bytes, SZ_LANES)
SIZE_ENTRY(sketch_buckets, SZ_SKETCH)
SIZE_ENTRY(sparse_bytes, SZ_SPARSE)
SIZE_ENTRY(quant_bytes, SZ_QUANT)
SIZE_ENTRY(pairs_bytes, SZ_PAIRS)
SIZE_ENTRY(pairs_cheapest, SZ_CHEAPEST)
SIZE_ENTRY(wq_bytes, SZ_WQ)
SIZE_ENTRY(fp4_bytes, SZ_FP4)
SIZE_ENTRY(wq_delta_bytes, SZ_WQ_DELTA)
SIZE_ENTRY(tls_bytes, SZ_TLS)

/* What a refused message means for the caller. */
static const char *wq_detail(tagc_status st)
{
    if (st == TAGC_ERR_NONFINITE)
        return "a block of the message holds NaN/Inf weights (sent unquantized: gather "
               "exactly)";
    if (st == TAGC_ERR_CORRUPT)
        return "buf holds a code outside the format or an invalid scale (out untouched)";
    return NULL;
}

/* wq_encode and wq_decode: the same checks; the data (src, read, or out,
 * written) and the message swap places in the argument list. */
static PyObject *wq_common(PyObject *m, PyObject *args, PyObject *kw, int decode)
{
    static char *kw_enc[] = {"buf", "src", "segs", "format", "block", "stream", "status_out",
                             NULL};
    static char *kw_dec[] = {"out", "buf", "segs", "format", "block", "stream", "status_out",
                             NULL};
    PyObject *o1, *o2, *osegs, *ofmt, *oblock, *ostream = NULL, *ostatus = NULL;
    TAGC_BEGIN("wq_encode");
    if (decode)
        vs_.fn = fn = "_tagc.wq_decode";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$OO", decode ? kw_dec : kw_enc, &o1, &o2,
                                     &osegs, &ofmt, &oblock, &ostream, &ostatus))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    tagc_qformat fmt;
    int64_t block;
    segs_t segs;
    TAGC_CHECK(arg_quant(fn, ofmt, oblock, 1, &fmt, &block));
    TAGC_TAKE(first, o1, decode ? "out" : "buf", decode ? TAGC_K_F32 | TAGC_K_BF16 : TAGC_K_U8);
    TAGC_TAKE(second, o2, decode ? "buf" : "src", decode ? TAGC_K_U8 : TAGC_K_F32 | TAGC_K_BF16);
    tagc_py_view *data = decode ? first : second, *buf = decode ? second : first;
    TAGC_CHECK(arg_segs(&vs_, osegs, &segs));
    TAGC_TAKE_STATUS(ostatus);
    TAGC_CHECK(tagc_py_need_max_n(&vs_, data));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_CHECK(segs_for(&vs_, &segs, dev, data));
    tagc_dtype dt = tagc_py_codec_dtype(data->kind);
    if (dev != TAGC_DEV_CUDA) /* CUDA: a table not matching the tensors: in status_out */
        TAGC_CHECK(tagc_py_need_size(&vs_, buf, tagc_wq_bytes(segs.len, segs.n, fmt, block), 1,
                                     "wq_bytes(segs, format, block)"));
    if (decode) /* CORRUPT: out untouched; NONFINITE (CUDA): NaN blocks */
        TAGC_RUN_BOTH(dev, data, tagc_cuda_wq_decode_workspace_size(segs.n), wq_decode,
                      (data->data, dt, data->numel, buf->data, buf->numel, segs.len, segs.n,
                       fmt, block),
                      has_status ? status->data : NULL, ws_, wsb_, strm_);
    else
        TAGC_RUN_BOTH(dev, data, tagc_cuda_wq_encode_workspace_size(segs.n), wq_encode,
                      (buf->data, buf->numel, data->data, dt, data->numel, segs.len, segs.n,
                       fmt, block),
                      has_status ? status->data : NULL, ws_, wsb_, strm_);
    TAGC_END_NONE(st, wq_detail(st));
}

static PyObject *py_wq_encode(PyObject *m, PyObject *args, PyObject *kw)
{
    return wq_common(m, args, kw, 0);
}

static PyObject *py_wq_decode(PyObject *m, PyObject *args, PyObject *kw)
{
    return wq_common(m, args, kw, 1);
}

/* The tensors of one delta op hold the same dtype (the codec reads them as
 * one dtype) and the same number of values. */
static int need_like(tagc_py_views *vs, const tagc_py_view *v, const tagc_py_view *like)
{
    if (v->kind != like->kind) {
        PyErr_Format(PyExc_TypeError, "%s: '%s' and '%s' must have the same dtype", vs->fn,
                     v->name, like->name);
        return -1;
    }
    return tagc_py_need_size(vs, v, like->numel, 1, like->name);
}

static PyObject *py_wq_delta_encode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"buf", "src", "sent", "base", "segs", "format", "block", "stream",
                          "status_out", NULL};
    PyObject *obuf, *osrc, *osent, *obase, *osegs, *ofmt, *oblock, *ostream = NULL,
             *ostatus = NULL;
    TAGC_BEGIN("wq_delta_encode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOO|$OO", kwl, &obuf, &osrc, &osent, &obase,
                                     &osegs, &ofmt, &oblock, &ostream, &ostatus))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    tagc_qformat fmt;
    int64_t block;
    segs_t segs;
    TAGC_CHECK(arg_quant(fn, ofmt, oblock, 1, &fmt, &block));
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_TAKE(src, osrc, "src", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(sent, osent, "sent", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(base, obase, "base", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_CHECK(arg_segs(&vs_, osegs, &segs));
    TAGC_TAKE_STATUS(ostatus);
    TAGC_CHECK(tagc_py_need_max_n(&vs_, src));
    TAGC_CHECK(need_like(&vs_, sent, src));
    TAGC_CHECK(need_like(&vs_, base, src));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_CHECK(segs_for(&vs_, &segs, dev, src));
    if (dev != TAGC_DEV_CUDA)
        TAGC_CHECK(tagc_py_need_size(&vs_, buf,
                                     tagc_wq_delta_bytes(segs.len, segs.n, fmt, block), 1,
                                     "wq_delta_bytes(segs, format, block)"));
    /* CUDA: a table not matching the tensors or the buffer: in status_out */
    TAGC_RUN_BOTH(dev, src, tagc_cuda_wq_delta_encode_workspace_size(segs.n), wq_delta_encode,
                  (buf->data, buf->numel, src->data, sent->data, base->data,
                   tagc_py_codec_dtype(src->kind), src->numel, segs.len, segs.n, fmt, block),
                  has_status ? status->data : NULL, ws_, wsb_, strm_);
    TAGC_END_NONE(TAGC_OK, NULL);
}

static PyObject *py_wq_delta_decode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "ref", "buf", "segs", "format", "block", "stream",
                          "status_out", NULL};
    PyObject *oout, *oref, *obuf, *osegs, *ofmt, *oblock, *ostream = NULL, *ostatus = NULL;
    TAGC_BEGIN("wq_delta_decode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|$OO", kwl, &oout, &oref, &obuf, &osegs,
                                     &ofmt, &oblock, &ostream, &ostatus))
        return NULL;
    TAGC_CHECK(tagc_py_arg_stream(fn, ostream, &stream));
    tagc_qformat fmt;
    int64_t block;
    segs_t segs;
    TAGC_CHECK(arg_quant(fn, ofmt, oblock, 1, &fmt, &block));
    /* out=None: the change is added to ref in place (no other view may
     * share ref's memory) */
    TAGC_TAKE_OPT(out, has_out, oout, "out", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(ref, oref, "ref", TAGC_K_F32 | TAGC_K_BF16);
    TAGC_TAKE(buf, obuf, "buf", TAGC_K_U8);
    TAGC_CHECK(arg_segs(&vs_, osegs, &segs));
    TAGC_TAKE_STATUS(ostatus);
    TAGC_CHECK(tagc_py_need_max_n(&vs_, ref));
    if (has_out)
        TAGC_CHECK(need_like(&vs_, out, ref));
    int dev = tagc_py_common_device(&vs_);
    TAGC_CHECK(dev);
    TAGC_CHECK(segs_for(&vs_, &segs, dev, ref));
    if (dev != TAGC_DEV_CUDA)
        TAGC_CHECK(tagc_py_need_size(&vs_, buf,
                                     tagc_wq_delta_bytes(segs.len, segs.n, fmt, block), 1,
                                     "wq_delta_bytes(segs, format, block)"));
    void *dst = has_out ? out->data : ref->data;
    /* CORRUPT: out and ref untouched; NONFINITE (CUDA): NaN blocks */
    TAGC_RUN_BOTH(dev, ref, tagc_cuda_wq_delta_decode_workspace_size(segs.n), wq_delta_decode,
                  (dst, ref->data, tagc_py_codec_dtype(ref->kind), ref->numel, buf->data,
                   buf->numel, segs.len, segs.n, fmt, block),
                  has_status ? status->data : NULL, ws_, wsb_, strm_);
    TAGC_END_NONE(st, wq_detail(st));
}

static PyObject *py_set_dlpack_exporter(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"type", "exporter", NULL};
    PyObject *type, *fn;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO", kwl, &type, &fn))
        return NULL;
    if ((type == Py_None) != (fn == Py_None) ||
        (type != Py_None && (!PyType_Check(type) || !PyCallable_Check(fn)))) {
        PyErr_SetString(PyExc_TypeError, "_tagc.set_dlpack_exporter: arguments must be a type "
                                         "and a callable, or None and None");
        return NULL;
    }
    tagc_py_state *s = tagc_py_get_state(m);
    Py_CLEAR(s->export_type);
    Py_CLEAR(s->export_fn);
    if (type != Py_None) {
        s->export_type = Py_NewRef(type);
        s->export_fn = Py_NewRef(fn);
    }
    Py_RETURN_NONE;
}

static PyObject *py_cuda_available(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
#ifdef TAGC_WITH_CUDA
    int yes;
    Py_BEGIN_ALLOW_THREADS
    yes = tagc_cudamod_available();
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(yes);
#else
    Py_RETURN_FALSE;
#endif
}

#define KW(name, doc) {#name, (PyCFunction)(void (*)(void))py_##name, \
                       METH_VARARGS | METH_KEYWORDS, doc}

/* Docstrings open with a text signature ("name(...)\n--\n\n"), which
 * inspect.signature() reads; the contract is docs/module-api.md. */
#define SIG(name, args, doc) #name "(" args ")\n--\n\n" doc

static PyMethodDef methods[] = {
    KW(seed_derive, SIG(seed_derive, "seed, unit, step",
                        "Per-call sketch seed (uint64) from (config seed, unit, step).")),
    KW(bitmap_bytes, SIG(bitmap_bytes, "n", "Bytes of an n-position bitmap: ceil(n / 8).")),
    KW(lanes_bytes, SIG(lanes_bytes, "n, bits", "Bytes of n lanes of `bits` bits.")),
    KW(sketch_buckets, SIG(sketch_buckets, "t", "Buckets of a sketch of t per table: 3t.")),
    KW(sparse_bytes, SIG(sparse_bytes, "k, value_dtype",
                         "Bytes of k (offset, value) pairs: k * (4 + value size).")),
    KW(quant_bytes, SIG(quant_bytes, "n, format, block",
                        "Wire size of n block-quantized values.")),
    KW(pairs_bytes, SIG(pairs_bytes, "n, k, value_dtype, coding",
                        "Wire size of k coded pairs of a shard of n ('ef', 'bitmap', 'dense').")),
    KW(pairs_cheapest, SIG(pairs_cheapest, "n, k, value_dtype",
                           "The coding of fewest bytes for (n, k, value_dtype).")),
    KW(select_kth, SIG(select_kth, "x, k, *, out=None, stream=0",
                       "k-th largest |x|; returns it (or writes out=).")),
    KW(sparsify, SIG(sparsify, "idx, val, bitmap, residual, grad, k, *, out=None, stream=0",
                     "Fused error feedback + exact top-k + bitmap; returns the threshold.")),
    KW(lanes_pack, SIG(lanes_pack, "lanes, bitmap, n, bits, *, stream=0",
                       "Bitmap -> lanes of `bits` bits.")),
    KW(lanes_unpack, SIG(lanes_unpack, "bitmap, lanes, n, bits, *, stream=0",
                         "Lanes (SUM-reduced, carries and all) -> bitmap.")),
    KW(bitmap_or, SIG(bitmap_or, "dst, src, count, *, stream=0", "OR of count bitmaps.")),
    KW(popcount, SIG(popcount, "bitmap, n, *, out=None, stream=0",
                     "Set bits among the first n.")),
    KW(sketch_encode, SIG(sketch_encode,
                          "sketch, idx, val, n, t, seed, *, stream=0, status_out=None",
                          "Count sketch of 3t buckets of k (position, value) pairs.")),
    KW(peel_decode, SIG(peel_decode,
                        "out, sketch, bitmap, n, t, seed, *, unpeeled=None, estimate=True, "
                        "count_out=None, stream=0",
                        "Peel the union's values from a summed sketch; returns the count "
                        "left unpeeled.")),
    KW(sparse_pack, SIG(sparse_pack, "buf, idx, val, *, stream=0",
                        "(offset, value) pairs wire format.")),
    KW(sparse_unpack, SIG(sparse_unpack, "out, buf, k, value_dtype, *, stream=0, "
                          "status_out=None", "Scatter-add k received pairs into out.")),
    KW(pairs_pack, SIG(pairs_pack, "buf, idx, val, n, coding, *, stream=0, status_out=None",
                       "k ascending (position, value) pairs of a shard of n, coded.")),
    KW(pairs_unpack_add, SIG(pairs_unpack_add,
                             "out, buf, k, value_dtype, coding, *, stream=0, status_out=None",
                             "out += the k coded pairs of buf.")),
    KW(quant_encode, SIG(quant_encode, "buf, residual, grad, format, block, *, stream=0",
                         "Error feedback + block quantization of one shard.")),
    KW(quant_decode_add, SIG(quant_decode_add,
                             "out, buf, format, block, *, stream=0, status_out=None",
                             "out += the decoded values of one quantized shard.")),
    KW(quant_unit_encode,
       SIG(quant_unit_encode,
           "buf, rcodes, grad, world, rank, format, residual_format, block, factor, *, "
           "counts=None, vote=None, flags=None, stream=0",
           "One unit's quant messages to every other rank, with the residual kept as codes "
           "(rcodes, updated): decode, feed back, encode, re-code in one call.  Returns "
           "whether the residual was reset (CPU; CUDA: added to counts).")),
    KW(quant_unit_decode,
       SIG(quant_unit_decode, "out, buf, own, world, rank, format, block, divisor, *, stream=0",
           "out = (the own shard + every other rank's decoded message, in rank order) / "
           "divisor.")),
    KW(wq_bytes, SIG(wq_bytes, "segs, format, block",
                     "Wire size of one rank's parameter shard (segments segs) as a wq message.")),
    KW(wq_encode, SIG(wq_encode, "buf, src, segs, format, block, *, stream=0, status_out=None",
                      "One rank's parameter shard as int8/int4 block records (NaN/Inf blocks "
                      "flagged).")),
    KW(wq_decode, SIG(wq_decode, "out, buf, segs, format, block, *, stream=0, status_out=None",
                      "out = the weights of one wq message (raises NonFiniteError for a "
                      "flagged block).")),
    KW(wq_delta_bytes, SIG(wq_delta_bytes, "segs, format, block",
                           "Wire size of a gather_delta message: wq_bytes + 1 flag byte.")),
    KW(wq_delta_encode, SIG(wq_delta_encode,
                            "buf, src, sent, base, segs, format, block, *, stream=0, "
                            "status_out=None",
                            "The codes of src - base and the changed flag (all zeros when "
                            "src == sent); sent = src.")),
    KW(wq_delta_decode, SIG(wq_delta_decode,
                            "out, ref, buf, segs, format, block, *, stream=0, status_out=None",
                            "ref += the decoded change of a flagged message; out = ref "
                            "(out=None: in place).")),
    KW(fp4_bytes, SIG(fp4_bytes, "n, block",
                      "Wire size of n 4-bit coded values: ceil(n / 2) + ceil(n / block).")),
    KW(fp4_encode, SIG(fp4_encode, "buf, residual, grad, block, *, seed=0, rotate=False, "
                       "stochastic=False, stream=0",
                       "Error feedback + E2M1 codes with E8M0 block scales (MXFP4-style), "
                       "optionally rotated.")),
    KW(fp4_decode_add, SIG(fp4_decode_add, "out, buf, block, *, seed=0, rotate=False, stream=0",
                           "out += the decoded values of one fp4 shard.")),
    KW(tls_bytes, SIG(tls_bytes, "n",
                      "Wire size of n values as ternary codes with two-level log scales.")),
    KW(tls_encode, SIG(tls_encode, "buf, residual, grad, *, stream=0",
                       "Error feedback + ternary codes under block scales of 32 coded on "
                       "4 bits below group scales of 512 coded on 8.")),
    KW(tls_decode_add, SIG(tls_decode_add, "out, buf, *, stream=0, status_out=None",
                           "out += the decoded values of one tls shard.")),
    KW(rht, SIG(rht, "dst, src, block, seed, *, inverse=False, stream=0",
                "dst = the seeded block Hadamard rotation of src (or its inverse).")),
    KW(set_dlpack_exporter,
       SIG(set_dlpack_exporter, "type, exporter",
           "Export tensors of exactly `type` with exporter(t) -> a 'dltensor' capsule instead "
           "of t.__dlpack__() (None, None: none).  tagc registers torch._C._to_dlpack for "
           "torch.Tensor: the same capsule without the Python method's cost.")),
    {"cuda_available", py_cuda_available, METH_NOARGS,
     SIG(cuda_available, "",
         "Whether the CUDA kernels are built in and a CUDA device is usable.")},
    {NULL, NULL, 0, NULL}
};

static int mod_exec(PyObject *module)
{
    tagc_py_state *s = tagc_py_get_state(module);
    s->nonfinite_error = PyErr_NewExceptionWithDoc(
        "_tagc.NonFiniteError",
        "NaN or Inf where the op needs finite values (grad + residual, or a wq "
        "message's weights); nothing was written.",
        PyExc_ValueError, NULL);
    if (s->nonfinite_error == NULL)
        return -1;
    if (PyModule_AddObjectRef(module, "NonFiniteError", s->nonfinite_error) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "MAX_N", (long)TAGC_MAX_N) < 0 ||
        PyModule_AddIntConstant(module, "TABLES", TAGC_TABLES) < 0 ||
        PyModule_AddIntConstant(module, "FORMAT_VERSION", TAGC_FORMAT_VERSION) < 0)
        return -1;
    return 0;
}

static int mod_traverse(PyObject *module, visitproc visit, void *arg)
{
    tagc_py_state *s = tagc_py_get_state(module);
    Py_VISIT(s->nonfinite_error);
    Py_VISIT(s->export_type);
    Py_VISIT(s->export_fn);
    return 0;
}

static int mod_clear(PyObject *module)
{
    tagc_py_state *s = tagc_py_get_state(module);
    Py_CLEAR(s->nonfinite_error);
    Py_CLEAR(s->export_type);
    Py_CLEAR(s->export_fn);
    return 0;
}

static void mod_free(void *module)
{
    mod_clear((PyObject *)module);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, mod_exec},
    {0, NULL}
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_tagc",
    .m_doc = "TAGC gradient codec (C kernels of csrc/tagc.h); see docs/module-api.md.",
    .m_size = sizeof(tagc_py_state),
    .m_methods = methods,
    .m_slots = slots,
    .m_traverse = mod_traverse,
    .m_clear = mod_clear,
    .m_free = mod_free,
};

PyMODINIT_FUNC PyInit__tagc(void)
{
    return PyModuleDef_Init(&moddef);
}
