/*
 * tagc_args.h - the argument machinery of the CPython module `_tagc`
 * (_tagcmodule.c, beside it): tensor arguments as checked DLPack views,
 * scalar arguments, a codec status as a Python exception, and the macros of
 * an entry point's ritual.  Internal: only _tagcmodule.c includes it, and the
 * functions (tagc_args.c) are hidden from the module's symbol table.
 *
 * Every tensor argument is read through its legacy DLPack capsule, checked
 * (dtype, device, contiguity, size) before any memory is touched, and kept
 * alive by holding the capsule until the call returns.  The capsule is never
 * consumed, so its own destructor releases the producer's tensor.
 *
 * Errors: a function returning int gives 0, or -1 with a Python exception set
 * that names the function (views->fn or fn) and the argument: TypeError for
 * type/dtype/device/contiguity, ValueError for size/range/overlap.
 */
#ifndef TAGC_ARGS_H
#define TAGC_ARGS_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "dlpack_min.h"
#include "tagc.h"
#ifdef TAGC_WITH_CUDA
#include "tagc_cuda.h"
#include "tagc_cuda_module.h"
#endif

#if defined(__GNUC__) || defined(__clang__)
#define TAGC_PY_INTERNAL __attribute__((visibility("hidden")))
#else
#define TAGC_PY_INTERNAL
#endif

/* The module's state: the exception class of TAGC_ERR_NONFINITE, and the
 * registered fast DLPack exporter (set_dlpack_exporter): objects of exactly
 * export_type are exported by export_fn(obj) instead of obj.__dlpack__()
 * (both NULL: none registered). */
typedef struct {
    PyObject *nonfinite_error;
    PyObject *export_type;
    PyObject *export_fn;
} tagc_py_state;

static inline tagc_py_state *tagc_py_get_state(PyObject *module)
{
    return (tagc_py_state *)PyModule_GetState(module);
}

/* ---- dtypes and views ------------------------------------------------- */

/* Element kinds, one bit each: a set of allowed kinds is their OR. */
enum { TAGC_K_F32 = 1, TAGC_K_BF16 = 2, TAGC_K_U8 = 4, TAGC_K_I32 = 8, TAGC_K_I64 = 16 };
enum { TAGC_DEV_CPU = 0, TAGC_DEV_CUDA = 1 };

/* The codec's value dtype of a float kind. */
static inline tagc_dtype tagc_py_codec_dtype(unsigned kind)
{
    return kind == TAGC_K_BF16 ? TAGC_BF16 : TAGC_F32;
}

typedef struct {
    PyObject *capsule; /* owned; NULL when the argument was None */
    const char *name;
    void *data;
    int64_t numel;
    unsigned kind;
    int device;
    int device_id;
} tagc_py_view;

#define TAGC_PY_MAX_VIEWS 6

/* The tensor arguments of one call, released together. */
typedef struct {
    tagc_py_view v[TAGC_PY_MAX_VIEWS];
    tagc_py_view none; /* what an omitted optional tensor reads as */
    int n;
    const char *fn;
    int64_t *owned; /* PyMem copy of a sequence argument (wq's segs), or NULL */
    PyObject *export_type, *export_fn; /* the module state's (borrowed), or NULL */
} tagc_py_views;

/* Drops every capsule (and `owned`); vs may be taken from again. */
TAGC_PY_INTERNAL void tagc_py_views_release(tagc_py_views *vs);

/* Exports obj through DLPack into vs and checks everything about it but its
 * size: a dtype among `allowed` (TAGC_K_* bits), CPU or CUDA memory, compact
 * row-major layout, not requiring grad.  Returns NULL with TypeError/
 * ValueError naming the argument on failure. */
TAGC_PY_INTERNAL tagc_py_view *tagc_py_view_take(tagc_py_views *vs, PyObject *obj,
                                                 const char *name, unsigned allowed);

/* Like tagc_py_view_take, but None (or NULL) gives an empty view (data NULL,
 * numel 0) and *present = 0. */
TAGC_PY_INTERNAL tagc_py_view *tagc_py_view_take_opt(tagc_py_views *vs, PyObject *obj,
                                                     const char *name, unsigned allowed,
                                                     int *present);

/* The one device of all tensor arguments (TAGC_DEV_*), which must not share
 * memory, or -1.  Every entry point dispatches on the device: a CUDA build
 * adds `#ifdef TAGC_WITH_CUDA` branches calling the tagc_cuda_* launchers
 * where the CPU kernel is called.  No op has an in-place form: each reads its
 * inputs while writing its outputs, so overlapping arguments would give wrong
 * results (never out-of-bounds access); they are refused here.  Without CUDA
 * kernels a CUDA tensor is refused too. */
TAGC_PY_INTERNAL int tagc_py_common_device(tagc_py_views *vs);

/* v has exactly (exact) or at least `need` elements; `what` says why. */
TAGC_PY_INTERNAL int tagc_py_need_size(tagc_py_views *vs, const tagc_py_view *v, int64_t need,
                                       int exact, const char *what);

/* Positions inside a shard are int32: at most TAGC_MAX_N elements. */
TAGC_PY_INTERNAL int tagc_py_need_max_n(tagc_py_views *vs, const tagc_py_view *v);

/* An optional 1-element result tensor has 1 element. */
TAGC_PY_INTERNAL int tagc_py_scalar_out_ok(tagc_py_views *vs, tagc_py_view *out, int present);

/* ---- scalar arguments -------------------------------------------------- */

/* Python ints only (bools and floats are refused), in range. */
TAGC_PY_INTERNAL int tagc_py_arg_i64(const char *fn, PyObject *o, const char *name,
                                     int64_t *out);
TAGC_PY_INTERNAL int tagc_py_arg_range(const char *fn, PyObject *o, const char *name,
                                       int64_t lo, int64_t hi, int64_t *out);
TAGC_PY_INTERNAL int tagc_py_arg_u64(const char *fn, PyObject *o, const char *name,
                                     uint64_t *out);

/* The caller's cudaStream_t as an int (None or absent: 0, the legacy default
 * stream). */
TAGC_PY_INTERNAL int tagc_py_arg_stream(const char *fn, PyObject *o, int64_t *s);

/* value_dtype: torch.float32 / torch.bfloat16 compared by name, so the module
 * never imports torch. */
TAGC_PY_INTERNAL int tagc_py_arg_value_dtype(const char *fn, PyObject *o, tagc_dtype *out);

/* On CUDA a scalar result goes to a device tensor: returning a Python number
 * would need a host sync, so the result tensor `name` is required there. */
TAGC_PY_INTERNAL int tagc_py_cuda_needs(const char *fn, int dev, int present, const char *name);

/* ---- results ----------------------------------------------------------- */

/* Raises the exception of a codec status (NONFINITE: _tagc.NonFiniteError,
 * DTYPE: TypeError, NOMEM: MemoryError, CUDA: RuntimeError, else ValueError)
 * with `detail` appended when not NULL; returns NULL. */
TAGC_PY_INTERNAL PyObject *tagc_py_raise_status(PyObject *module, const char *fn,
                                                tagc_status st, const char *detail);

/* Writes a scalar result to a 1-element `out` tensor (already checked to be of
 * the result's dtype) and returns None, or returns it when out is absent. */
TAGC_PY_INTERNAL PyObject *tagc_py_float_result(tagc_py_view *out, int present, float f);
TAGC_PY_INTERNAL PyObject *tagc_py_int_result(tagc_py_view *out, int present, int64_t i);

/* A new reference to None. */
TAGC_PY_INTERNAL PyObject *tagc_py_none_result(void);

/* ---- an entry point's ritual ------------------------------------------- */

/* An entry point `py_NAME(PyObject *m, ...)` starts with TAGC_BEGIN("NAME"),
 * takes its tensors with TAGC_TAKE*, checks with TAGC_CHECK (which jumps to
 * `done` on failure), calls the kernel in TAGC_RUN / TAGC_RUN_CUDA (status in
 * `st`), and ends with TAGC_END_NONE or its own `done:` that releases vs_. */
#define TAGC_BEGIN(fname)                                     \
    tagc_py_views vs_;                                        \
    memset(&vs_, 0, sizeof vs_);                              \
    vs_.fn = "_tagc." fname;                                  \
    vs_.export_type = tagc_py_get_state(m)->export_type;      \
    vs_.export_fn = tagc_py_get_state(m)->export_fn;          \
    const char *fn = vs_.fn;                                  \
    PyObject *ret = NULL;                                     \
    tagc_status st = TAGC_OK;                                 \
    int64_t stream = 0;                                       \
    (void)st;                                                 \
    (void)stream
#define TAGC_TAKE(var, obj, name, allowed)                               \
    tagc_py_view *var = tagc_py_view_take(&vs_, obj, name, allowed);     \
    if (var == NULL)                                                     \
        goto done
#define TAGC_TAKE_OPT(var, present, obj, name, allowed)                             \
    int present;                                                                    \
    tagc_py_view *var = tagc_py_view_take_opt(&vs_, obj, name, allowed, &present);  \
    if (var == NULL)                                                                \
        goto done
/* The optional `status_out=` of the functions whose data errors a CUDA launch
 * reports on the device: a 1-element int32 tensor, or absent. */
#define TAGC_TAKE_STATUS(obj)                                              \
    TAGC_TAKE_OPT(status, has_status, obj, "status_out", TAGC_K_I32);      \
    TAGC_CHECK(tagc_py_scalar_out_ok(&vs_, status, has_status))
#define TAGC_CHECK(expr) \
    if ((expr) < 0)      \
        goto done
#define TAGC_RUN(call)          \
    Py_BEGIN_ALLOW_THREADS      \
    st = (call);                \
    Py_END_ALLOW_THREADS

/* The end of the entry ritual of a function that returns None: the status
 * raised (with `detail` when it is `err`), the views released. */
#define TAGC_END_NONE(err, detail)                                                        \
    ret = st == TAGC_OK ? tagc_py_none_result()                                           \
                        : tagc_py_raise_status(m, fn, st, st == (err) ? (detail) : NULL); \
done:                                                                                     \
    tagc_py_views_release(&vs_);                                                          \
    return ret

/* CUDA path (TAGC_WITH_CUDA): the tensors' device is made current, the
 * launcher gets a workspace of `wsb` bytes allocated in stream order on the
 * caller's stream (names ws_, wsb_, strm_ are visible to `call`), and
 * nothing waits for the GPU.  Without CUDA it expands to nothing: the
 * launchers do not exist, and tagc_py_common_device() has refused CUDA
 * tensors. */
#ifdef TAGC_WITH_CUDA
#define TAGC_RUN_CUDA(view, wsb, call)                                         \
    do {                                                                       \
        void *ws_ = NULL;                                                      \
        size_t wsb_ = (wsb);                                                   \
        int prev_ = 0;                                                         \
        cudaStream_t strm_ = (cudaStream_t)(uintptr_t)stream;                  \
        Py_BEGIN_ALLOW_THREADS                                                 \
        st = tagc_cudamod_begin((view)->device_id, wsb_, strm_, &ws_, &prev_); \
        if (st == TAGC_OK) {                                                   \
            st = (call);                                                       \
            tagc_status end_ = tagc_cudamod_end(ws_, strm_, prev_);            \
            if (st == TAGC_OK)                                                 \
                st = end_;                                                     \
        }                                                                      \
        Py_END_ALLOW_THREADS                                                   \
    } while (0)
#else
#define TAGC_RUN_CUDA(view, wsb, call) ((void)0)
#endif

/* A kernel's two paths from one argument list: tagc_<op>(ARGS) on the CPU,
 * tagc_cuda_<op>(ARGS, TAIL...) on CUDA through TAGC_RUN_CUDA with a workspace
 * of `wsb` bytes.  `args` is the parenthesised list both take; the tail is
 * what only the launcher takes (a status tensor, ws_, wsb_, strm_).  Entry
 * points whose CPU function returns to the host what the launcher writes to
 * the device (a count, a threshold) call the two themselves. */
#define TAGC_LIST_(...) __VA_ARGS__
#define TAGC_RUN_BOTH(dev, view, wsb, op, args, ...)                                 \
    do {                                                                             \
        if ((dev) == TAGC_DEV_CUDA) {                                                \
            TAGC_RUN_CUDA(view, wsb, tagc_cuda_##op(TAGC_LIST_ args, __VA_ARGS__));  \
        } else {                                                                     \
            TAGC_RUN(tagc_##op(TAGC_LIST_ args));                                    \
        }                                                                            \
    } while (0)

#endif /* TAGC_ARGS_H */
