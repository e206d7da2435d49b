/*
 * _tagcmodule.c - the CPython module `_tagc`: argument checks and DLPack views
 * over the C codec of tagc.h.  Contract: docs/module-api.md.
 *
 * The top C layer: it includes the codec (csrc/) and, in CUDA builds, the
 * kernels' launchers (cuda/) and the glue beside it; nothing below includes
 * anything from here, so the codec and the kernels build without Python.
 *
 * Every tensor argument is read through its legacy DLPack capsule, checked
 * (dtype, device, contiguity, size) before any memory is touched, and kept
 * alive by holding the capsule until the call returns.  The capsule is never
 * consumed, so its own destructor releases the producer's tensor.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

#include "dlpack_min.h"
#include "tagc.h"
#include "tagc_portable.h"
#ifdef TAGC_WITH_CUDA
#include "tagc_cuda.h"
#include "tagc_cuda_module.h"
#endif

typedef struct {
    PyObject *nonfinite_error;
} mod_state;

static mod_state *get_state(PyObject *module)
{
    return (mod_state *)PyModule_GetState(module);
}

/* ---- dtypes and views ------------------------------------------------- */

enum { K_F32 = 1, K_BF16 = 2, K_U8 = 4, K_I32 = 8, K_I64 = 16 };
enum { DEV_CPU = 0, DEV_CUDA = 1 };

static const char *kind_name(unsigned k)
{
    switch (k) {
    case K_F32: return "float32";
    case K_BF16: return "bfloat16";
    case K_U8: return "uint8";
    case K_I32: return "int32";
    case K_I64: return "int64";
    }
    return "?";
}

static unsigned dl_kind(tagc_dl_dtype d)
{
    if (d.lanes != 1)
        return 0;
    if (d.code == TAGC_DL_FLOAT && d.bits == 32) return K_F32;
    if (d.code == TAGC_DL_BFLOAT && d.bits == 16) return K_BF16;
    if (d.code == TAGC_DL_UINT && d.bits == 8) return K_U8;
    if (d.code == TAGC_DL_INT && d.bits == 32) return K_I32;
    if (d.code == TAGC_DL_INT && d.bits == 64) return K_I64;
    return 0;
}

static tagc_dtype codec_dtype(unsigned kind)
{
    return kind == K_BF16 ? TAGC_BF16 : TAGC_F32;
}

typedef struct {
    PyObject *capsule; /* owned; NULL when the argument was None */
    const char *name;
    void *data;
    int64_t numel;
    unsigned kind;
    int device;
    int device_id;
} view_t;

#define MAX_VIEWS 6

typedef struct {
    view_t v[MAX_VIEWS];
    view_t none; /* what an omitted optional tensor reads as */
    int n;
    const char *fn;
    int64_t *owned; /* PyMem copy of a sequence argument (wq's segs), or NULL */
} views_t;

static void views_release(views_t *vs)
{
    for (int i = 0; i < vs->n; i++)
        Py_CLEAR(vs->v[i].capsule);
    vs->n = 0;
    PyMem_Free(vs->owned);
    vs->owned = NULL;
}

static void allowed_names(unsigned allowed, char *buf, size_t cap)
{
    buf[0] = '\0';
    for (unsigned k = 1; k <= K_I64; k <<= 1) {
        if (!(allowed & k))
            continue;
        if (buf[0])
            strncat(buf, " or ", cap - strlen(buf) - 1);
        strncat(buf, kind_name(k), cap - strlen(buf) - 1);
    }
}

/* The checks before any export: obj speaks DLPack and is not part of an
 * autograd graph (the kernels would write or read it behind autograd's
 * back).  A requires_grad that cannot be read counts as False: plain
 * DLPack producers have none. */
static int view_precheck(const views_t *vs, PyObject *obj, const char *name)
{
    if (!PyObject_HasAttrString(obj, "__dlpack__")) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s' must be a tensor (an object with __dlpack__), "
                     "not %.100s", vs->fn, name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *rg = PyObject_GetAttrString(obj, "requires_grad");
    if (rg == NULL) {
        PyErr_Clear();
        return 0;
    }
    int yes = PyObject_IsTrue(rg);
    Py_DECREF(rg);
    if (yes < 0)
        return -1;
    if (yes) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' requires grad; pass tensor.detach()",
                     vs->fn, name);
        return -1;
    }
    return 0;
}

/* obj.__dlpack__() (a new reference), or NULL with the producer's error
 * re-raised as a TypeError that names the argument. */
static PyObject *view_export(const views_t *vs, PyObject *obj, const char *name)
{
    PyObject *cap = PyObject_CallMethod(obj, "__dlpack__", NULL);
    if (cap != NULL)
        return cap;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *msg = value ? PyObject_Str(value) : NULL;
    PyErr_Format(PyExc_TypeError,
                 "%s: argument '%s' cannot be exported with DLPack "
                 "(unsupported device or layout?): %S",
                 vs->fn, name, msg ? msg : Py_None);
    Py_XDECREF(msg);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return NULL;
}

/* v->kind and v->device from t: a dtype among `allowed`, memory the CPU
 * or a CUDA device can address. */
static int view_kind_device(const views_t *vs, view_t *v, const tagc_dl_tensor *t,
                            unsigned allowed)
{
    v->kind = dl_kind(t->dtype);
    if (!(v->kind & allowed)) {
        char want[96];
        allowed_names(allowed, want, sizeof want);
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s' must be %s, got DLPack dtype (code %d, %d bits, %d lanes)",
                     vs->fn, v->name, want, t->dtype.code, t->dtype.bits, t->dtype.lanes);
        return -1;
    }
    switch (t->device.device_type) {
    case TAGC_DL_CPU:
    case TAGC_DL_CUDA_HOST:
        v->device = DEV_CPU;
        break;
    case TAGC_DL_CUDA:
    case TAGC_DL_CUDA_MANAGED:
        v->device = DEV_CUDA;
        break;
    default:
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s' is on an unsupported device (DLPack device type %d)",
                     vs->fn, v->name, (int)t->device.device_type);
        return -1;
    }
    v->device_id = t->device.device_id;
    return 0;
}

/* v->numel and v->data from t: a valid shape whose element count fits in
 * int64, laid out compactly in row-major order (the kernels index it flat;
 * size-1 dimensions may have any stride), with data unless empty. */
static int view_extent(const views_t *vs, view_t *v, const tagc_dl_tensor *t)
{
    if (t->ndim < 0 || (t->ndim > 0 && t->shape == NULL)) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' has an invalid shape",
                     vs->fn, v->name);
        return -1;
    }
    int64_t numel = 1;
    for (int32_t d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0 ||
            (t->shape[d] > 0 && numel > INT64_MAX / t->shape[d])) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' has an invalid shape",
                         vs->fn, v->name);
            return -1;
        }
        numel *= t->shape[d];
    }
    if (t->strides != NULL && numel > 1) {
        int64_t expect = 1;
        for (int32_t d = t->ndim - 1; d >= 0; d--) {
            if (t->shape[d] != 1 && t->strides[d] != expect) {
                PyErr_Format(PyExc_TypeError,
                             "%s: argument '%s' must be contiguous (call .contiguous())",
                             vs->fn, v->name);
                return -1;
            }
            expect *= t->shape[d];
        }
    }
    v->numel = numel;
    v->data = t->data == NULL ? NULL : (char *)t->data + t->byte_offset;
    if (v->data == NULL && numel > 0) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' has no data", vs->fn, v->name);
        return -1;
    }
    return 0;
}

/* Exports obj through DLPack and checks everything about it but its size.
 * Returns NULL with TypeError/ValueError naming the argument on failure. */
static view_t *view_take(views_t *vs, PyObject *obj, const char *name,
                         unsigned allowed)
{
    if (vs->n >= MAX_VIEWS) {
        PyErr_SetString(PyExc_SystemError, "_tagc: too many tensor arguments");
        return NULL;
    }
    if (view_precheck(vs, obj, name) < 0)
        return NULL;
    PyObject *cap = view_export(vs, obj, name);
    if (cap == NULL)
        return NULL;
    /* Counted in vs at once: views_release() drops the capsule whatever
     * check fails next. */
    view_t *v = &vs->v[vs->n];
    memset(v, 0, sizeof *v);
    v->capsule = cap;
    v->name = name;
    vs->n++;
    if (!PyCapsule_IsValid(cap, "dltensor")) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s': __dlpack__ did not return a 'dltensor' capsule",
                     vs->fn, name);
        return NULL;
    }
    tagc_dl_managed *mt = PyCapsule_GetPointer(cap, "dltensor");
    if (mt == NULL)
        return NULL;
    if (view_kind_device(vs, v, &mt->dl_tensor, allowed) < 0 ||
        view_extent(vs, v, &mt->dl_tensor) < 0)
        return NULL;
    return v;
}

/* Like view_take, but None gives an empty view (data NULL, numel 0). */
static view_t *view_take_opt(views_t *vs, PyObject *obj, const char *name,
                             unsigned allowed, int *present)
{
    *present = obj != NULL && obj != Py_None;
    if (*present)
        return view_take(vs, obj, name, allowed);
    memset(&vs->none, 0, sizeof vs->none);
    vs->none.name = name;
    return &vs->none;
}

static int64_t kind_size(unsigned k)
{
    return k == K_I64 ? 8 : k == K_BF16 ? 2 : k == K_U8 ? 1 : 4;
}

/* The one device of all tensor arguments, which must not share memory.
 * Every entry point dispatches on the device: a CUDA build adds
 * `#ifdef TAGC_WITH_CUDA` branches calling the tagc_cuda_* launchers where
 * the CPU kernel is called.  No op has an in-place form: each reads its
 * inputs while writing its outputs, so overlapping arguments would give
 * wrong results (never out-of-bounds access); they are refused here. */
static int common_device(views_t *vs)
{
    if (vs->n == 0)
        return DEV_CPU;
    const view_t *a = &vs->v[0];
    for (int i = 1; i < vs->n; i++) {
        const view_t *b = &vs->v[i];
        if (b->device != a->device || b->device_id != a->device_id) {
            PyErr_Format(PyExc_TypeError,
                         "%s: arguments '%s' and '%s' are on different devices",
                         vs->fn, a->name, b->name);
            return -1;
        }
    }
    for (int i = 0; i < vs->n; i++) {
        const view_t *x = &vs->v[i];
        uintptr_t x0 = (uintptr_t)x->data;
        uintptr_t x1 = x0 + (uintptr_t)(x->numel * kind_size(x->kind));
        for (int j = i + 1; j < vs->n && x1 > x0; j++) {
            const view_t *y = &vs->v[j];
            uintptr_t y0 = (uintptr_t)y->data;
            uintptr_t y1 = y0 + (uintptr_t)(y->numel * kind_size(y->kind));
            if (y1 > y0 && x0 < y1 && y0 < x1) {
                PyErr_Format(PyExc_ValueError,
                             "%s: arguments '%s' and '%s' overlap in memory; pass "
                             "separate tensors", vs->fn, x->name, y->name);
                return -1;
            }
        }
    }
#ifndef TAGC_WITH_CUDA
    if (a->device == DEV_CUDA) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s' is a CUDA tensor, but _tagc was built "
                     "without CUDA kernels (CPU tensors only)", vs->fn, a->name);
        return -1;
    }
#endif
    return a->device;
}

static int need_size(views_t *vs, const view_t *v, int64_t need, int exact,
                     const char *what)
{
    if (exact ? v->numel != need : v->numel < need) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s' has %lld elements, needs %s%lld (%s)",
                     vs->fn, v->name, (long long)v->numel, exact ? "" : "at least ",
                     (long long)need, what);
        return -1;
    }
    return 0;
}

/* Positions inside a shard are int32: at most TAGC_MAX_N elements. */
static int need_max_n(views_t *vs, const view_t *v)
{
    if (v->numel > TAGC_MAX_N) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' has more than 2**31-1 elements",
                     vs->fn, v->name);
        return -1;
    }
    return 0;
}

/* ---- scalar arguments -------------------------------------------------- */

/* o as a Python int (new reference); bools and floats are refused. */
static PyObject *int_arg(const char *fn, PyObject *o, const char *name)
{
    if (PyBool_Check(o) || !PyIndex_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be an int, not %.100s",
                     fn, name, Py_TYPE(o)->tp_name);
        return NULL;
    }
    return PyNumber_Index(o);
}

static int arg_i64(const char *fn, PyObject *o, const char *name, int64_t *out)
{
    PyObject *i = int_arg(fn, o, name);
    if (i == NULL)
        return -1;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (overflow) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' is out of range", fn, name);
        return -1;
    }
    *out = x;
    return 0;
}

static int arg_range(const char *fn, PyObject *o, const char *name,
                     int64_t lo, int64_t hi, int64_t *out)
{
    if (arg_i64(fn, o, name, out) < 0)
        return -1;
    if (*out < lo || *out > hi) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be in [%lld, %lld], got %lld",
                     fn, name, (long long)lo, (long long)hi, (long long)*out);
        return -1;
    }
    return 0;
}

static int arg_u64(const char *fn, PyObject *o, const char *name, uint64_t *out)
{
    PyObject *i = int_arg(fn, o, name);
    if (i == NULL)
        return -1;
    PyObject *zero = PyLong_FromLong(0);
    int neg = zero == NULL ? -1 : PyObject_RichCompareBool(i, zero, Py_LT);
    Py_XDECREF(zero);
    unsigned long long x = neg ? 0 : PyLong_AsUnsignedLongLong(i);
    Py_DECREF(i);
    if (neg < 0)
        return -1;
    if (neg || (x == (unsigned long long)-1 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be in [0, 2**64)", fn, name);
        return -1;
    }
    *out = x;
    return 0;
}

/* The caller's cudaStream_t as an int (0: the legacy default stream). */
static int arg_stream(const char *fn, PyObject *o, int64_t *s)
{
    *s = 0;
    return o == NULL || o == Py_None ? 0 : arg_i64(fn, o, "stream", s);
}

/* value_dtype: torch.float32 / torch.bfloat16 compared by name, so the module
 * never imports torch. */
static int arg_value_dtype(const char *fn, PyObject *o, tagc_dtype *out)
{
    PyObject *s = PyObject_Str(o);
    if (s == NULL)
        return -1;
    const char *c = PyUnicode_AsUTF8(s);
    int ok = 1;
    if (c == NULL)
        ok = -1;
    else if (!strcmp(c, "torch.float32") || !strcmp(c, "float32"))
        *out = TAGC_F32;
    else if (!strcmp(c, "torch.bfloat16") || !strcmp(c, "bfloat16"))
        *out = TAGC_BF16;
    else
        ok = 0;
    Py_DECREF(s);
    if (ok == 0)
        PyErr_Format(PyExc_TypeError,
                     "%s: argument 'value_dtype' must be torch.float32 or torch.bfloat16, got %R",
                     fn, o);
    return ok == 1 ? 0 : -1;
}

/* ---- status -> exception ----------------------------------------------- */

static PyObject *raise_status(PyObject *module, const char *fn, tagc_status st,
                              const char *detail)
{
    PyObject *exc;
    switch (st) {
    case TAGC_ERR_NONFINITE: exc = get_state(module)->nonfinite_error; break;
    case TAGC_ERR_DTYPE: exc = PyExc_TypeError; break;
    case TAGC_ERR_NOMEM: exc = PyExc_MemoryError; break;
    case TAGC_ERR_CUDA: exc = PyExc_RuntimeError; break;
    default: exc = PyExc_ValueError; break;
    }
    PyErr_Format(exc, "%s: %s%s%s", fn, tagc_status_str(st), detail ? ": " : "",
                 detail ? detail : "");
    return NULL;
}

/* Writes a scalar result to a 1-element `out` tensor (already checked to be
 * of the result's dtype), or returns it. */
static PyObject *float_result(view_t *out, int present, float f)
{
    if (!present)
        return PyFloat_FromDouble(f);
    *(float *)out->data = f;
    Py_RETURN_NONE;
}

static PyObject *int_result(view_t *out, int present, int64_t i)
{
    if (!present)
        return PyLong_FromLongLong(i);
    *(int64_t *)out->data = i;
    Py_RETURN_NONE;
}

#define BEGIN(fname)                \
    views_t vs_;                    \
    memset(&vs_, 0, sizeof vs_);    \
    vs_.fn = "_tagc." fname;        \
    const char *fn = vs_.fn;        \
    PyObject *ret = NULL;           \
    tagc_status st = TAGC_OK;       \
    int64_t stream = 0;             \
    (void)st;                       \
    (void)stream
#define TAKE(var, obj, name, allowed)                          \
    view_t *var = view_take(&vs_, obj, name, allowed);         \
    if (var == NULL)                                           \
        goto done
#define TAKE_OPT(var, present, obj, name, allowed)                        \
    int present;                                                          \
    view_t *var = view_take_opt(&vs_, obj, name, allowed, &present);      \
    if (var == NULL)                                                      \
        goto done
/* The optional `status_out=` of the functions whose data errors a CUDA launch
 * reports on the device: a 1-element int32 tensor, or absent. */
#define TAKE_STATUS(obj)                                                  \
    TAKE_OPT(status, has_status, obj, "status_out", K_I32);               \
    CHECK(scalar_out_ok(&vs_, status, has_status))
#define CHECK(expr)     \
    if ((expr) < 0)     \
        goto done
#define RUN(call)                   \
    Py_BEGIN_ALLOW_THREADS          \
    st = (call);                    \
    Py_END_ALLOW_THREADS

/* The end of the entry ritual of a function that returns None: the status
 * raised (with `detail` when it is `err`), the views released. */
#define END_NONE(err, detail)                                                    \
    ret = st == TAGC_OK ? none_result()                                          \
                        : raise_status(m, fn, st, st == (err) ? (detail) : NULL); \
done:                                                                            \
    views_release(&vs_);                                                         \
    return ret

static int scalar_out_ok(views_t *vs, view_t *out, int present)
{
    return present ? need_size(vs, out, 1, 1, "a 1-element result tensor") : 0;
}

/* CUDA path (TAGC_WITH_CUDA): the tensors' device is made current, the
 * launcher gets a workspace of `wsb` bytes allocated in stream order on the
 * caller's stream (names ws_, wsb_, strm_ are visible to `call`), and
 * nothing waits for the GPU.  Without CUDA it expands to nothing: the
 * launchers do not exist, and common_device() has refused CUDA tensors. */
#ifdef TAGC_WITH_CUDA
#define RUN_CUDA(view, wsb, call)                                              \
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
#define RUN_CUDA(view, wsb, call) ((void)0)
#endif

/* On CUDA a scalar result goes to a device tensor: returning a Python
 * number would need a host sync, so the result tensor is required. */
static int cuda_needs(const char *fn, int dev, int present, const char *name)
{
    if (dev == DEV_CUDA && !present) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s' (a 1-element tensor on the data's device) is "
                     "required for CUDA tensors: returning a number would need a host sync",
                     fn, name);
        return -1;
    }
    return 0;
}

static PyObject *none_result(void)
{
    Py_RETURN_NONE;
}

/* ---- entry points ------------------------------------------------------ */

static PyObject *py_seed_derive(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"seed", "unit", "step", NULL};
    PyObject *a, *b, *c;
    const char *fn = "_tagc.seed_derive";
    uint64_t seed, unit, step;
    (void)m;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO", kwl, &a, &b, &c) ||
        arg_u64(fn, a, "seed", &seed) < 0 || arg_u64(fn, b, "unit", &unit) < 0 ||
        arg_u64(fn, c, "step", &step) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(tagc_seed_derive(seed, unit, step));
}

static PyObject *py_select_kth(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"x", "k", "out", "stream", NULL};
    PyObject *ox, *ok, *oout = NULL, *ostream = NULL;
    BEGIN("select_kth");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OO", kwl, &ox, &ok, &oout, &ostream))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(x, ox, "x", K_F32 | K_BF16);
    TAKE_OPT(out, has_out, oout, "out", K_F32);
    int64_t k;
    CHECK(arg_range(fn, ok, "k", 0, x->numel, &k));
    CHECK(scalar_out_ok(&vs_, out, has_out));
    CHECK(need_max_n(&vs_, x));
    int dev = common_device(&vs_);
    CHECK(dev);
    CHECK(cuda_needs(fn, dev, has_out, "out"));
    float tau = 0;
    if (dev == DEV_CUDA) { /* NaN/Inf: *out = NaN on the device, no exception */
        RUN_CUDA(x, tagc_cuda_select_kth_workspace_size(x->numel),
                 tagc_cuda_select_kth(out->data, x->data, codec_dtype(x->kind), x->numel,
                                      k, ws_, wsb_, strm_));
    } else {
        RUN(tagc_select_kth(&tau, x->data, codec_dtype(x->kind), x->numel, k));
    }
    if (st != TAGC_OK) {
        raise_status(m, fn, st, st == TAGC_ERR_NONFINITE ? "x holds NaN or Inf" : NULL);
        goto done;
    }
    ret = dev == DEV_CUDA ? none_result() : float_result(out, has_out, tau);
done:
    views_release(&vs_);
    return ret;
}

static PyObject *py_sparsify(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"idx", "val", "bitmap", "residual", "grad", "k",
                          "out", "stream", NULL};
    PyObject *oidx, *oval, *obm, *ores, *ograd, *ok, *oout = NULL, *ostream = NULL;
    BEGIN("sparsify");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|$OO", kwl, &oidx, &oval, &obm,
                                     &ores, &ograd, &ok, &oout, &ostream))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(idx, oidx, "idx", K_I32);
    TAKE(val, oval, "val", K_F32 | K_BF16);
    TAKE(bitmap, obm, "bitmap", K_U8);
    TAKE_OPT(res, has_res, ores, "residual", K_F32 | K_BF16);
    TAKE(grad, ograd, "grad", K_F32 | K_BF16);
    TAKE_OPT(out, has_out, oout, "out", K_F32);
    int64_t n = grad->numel, k;
    CHECK(need_max_n(&vs_, grad));
    CHECK(arg_range(fn, ok, "k", 0, n, &k));
    CHECK(need_size(&vs_, idx, k, 0, "k"));
    CHECK(need_size(&vs_, val, k, 0, "k"));
    CHECK(need_size(&vs_, bitmap, tagc_bitmap_bytes(n), 0, "bitmap_bytes(grad.numel())"));
    if (has_res)
        CHECK(need_size(&vs_, res, n, 1, "grad.numel()"));
    CHECK(scalar_out_ok(&vs_, out, has_out));
    int dev = common_device(&vs_);
    CHECK(dev);
    CHECK(cuda_needs(fn, dev, has_out, "out"));
    float tau = 0;
    if (dev == DEV_CUDA) { /* NaN/Inf: *out = NaN, see tagc_cuda.h */
        RUN_CUDA(grad, tagc_cuda_sparsify_workspace_size(n),
                 tagc_cuda_sparsify(idx->data, idx->numel, val->data, codec_dtype(val->kind),
                                    val->numel, bitmap->data, bitmap->numel,
                                    has_res ? res->data : NULL, codec_dtype(res->kind),
                                    grad->data, codec_dtype(grad->kind), n, k, out->data,
                                    ws_, wsb_, strm_));
    } else {
        RUN(tagc_sparsify(idx->data, idx->numel, val->data, codec_dtype(val->kind),
                          val->numel, bitmap->data, bitmap->numel,
                          has_res ? res->data : NULL, codec_dtype(res->kind),
                          grad->data, codec_dtype(grad->kind), n, k, &tau));
    }
    if (st != TAGC_OK) {
        raise_status(m, fn, st, st == TAGC_ERR_NONFINITE
                                    ? "grad + residual holds NaN or Inf (nothing written)"
                                    : NULL);
        goto done;
    }
    ret = dev == DEV_CUDA ? none_result() : float_result(out, has_out, tau);
done:
    views_release(&vs_);
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
    BEGIN("lanes_pack");
    if (unpack)
        vs_.fn = fn = "_tagc.lanes_unpack";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$O", unpack ? kw_unpack : kw_pack,
                                     &o1, &o2, &on, &obits, &ostream))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(first, o1, unpack ? "bitmap" : "lanes", K_U8);
    TAKE(second, o2, unpack ? "lanes" : "bitmap", K_U8);
    view_t *lanes = unpack ? second : first, *bitmap = unpack ? first : second;
    int64_t n, bits;
    CHECK(arg_range(fn, on, "n", 0, TAGC_MAX_N, &n));
    CHECK(arg_i64(fn, obits, "bits", &bits));
    CHECK(check_bits(fn, bits));
    CHECK(need_size(&vs_, bitmap, tagc_bitmap_bytes(n), 0, "bitmap_bytes(n)"));
    CHECK(need_size(&vs_, lanes, tagc_lanes_bytes(n, (int)bits), 0, "lanes_bytes(n, bits)"));
    int dev = common_device(&vs_);
    CHECK(dev);
    if (dev == DEV_CUDA && unpack) {
        RUN_CUDA(bitmap, 0, tagc_cuda_lanes_unpack(bitmap->data, bitmap->numel, lanes->data,
                                                   lanes->numel, n, (int)bits, strm_));
    } else if (dev == DEV_CUDA) {
        RUN_CUDA(bitmap, 0, tagc_cuda_lanes_pack(lanes->data, lanes->numel, bitmap->data, n,
                                                 (int)bits, strm_));
    } else if (unpack) {
        RUN(tagc_lanes_unpack(bitmap->data, bitmap->numel, lanes->data, lanes->numel, n,
                              (int)bits));
    } else {
        RUN(tagc_lanes_pack(lanes->data, lanes->numel, bitmap->data, n, (int)bits));
    }
    END_NONE(TAGC_OK, NULL);
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
    BEGIN("bitmap_or");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$O", kwl, &odst, &osrc, &ocount,
                                     &ostream))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(dst, odst, "dst", K_U8);
    TAKE(src, osrc, "src", K_U8);
    int64_t count;
    CHECK(arg_range(fn, ocount, "count", 1, INT64_MAX, &count));
    if (src->numel % count != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument 'src' has %lld elements, not a multiple of count=%lld",
                     fn, (long long)src->numel, (long long)count);
        goto done;
    }
    int64_t nbytes = src->numel / count;
    CHECK(need_size(&vs_, dst, nbytes, 0, "src.numel() // count"));
    int dev = common_device(&vs_);
    CHECK(dev);
    if (dev == DEV_CUDA) {
        RUN_CUDA(dst, 0, tagc_cuda_bitmap_or(dst->data, dst->numel, src->data, nbytes, count,
                                             strm_));
    } else {
        RUN(tagc_bitmap_or(dst->data, dst->numel, src->data, nbytes, count));
    }
    END_NONE(TAGC_OK, NULL);
}

static PyObject *py_popcount(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"bitmap", "n", "out", "stream", NULL};
    PyObject *obm, *on, *oout = NULL, *ostream = NULL;
    BEGIN("popcount");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OO", kwl, &obm, &on, &oout, &ostream))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(bitmap, obm, "bitmap", K_U8);
    TAKE_OPT(out, has_out, oout, "out", K_I64);
    int64_t n, count = 0;
    CHECK(arg_range(fn, on, "n", 0, TAGC_MAX_N, &n));
    CHECK(need_size(&vs_, bitmap, tagc_bitmap_bytes(n), 0, "bitmap_bytes(n)"));
    CHECK(scalar_out_ok(&vs_, out, has_out));
    int dev = common_device(&vs_);
    CHECK(dev);
    CHECK(cuda_needs(fn, dev, has_out, "out"));
    if (dev == DEV_CUDA) {
        RUN_CUDA(bitmap, 0, tagc_cuda_popcount(out->data, bitmap->data, n, strm_));
    } else {
        RUN(tagc_popcount(&count, bitmap->data, n));
    }
    if (st != TAGC_OK) {
        raise_status(m, fn, st, NULL);
        goto done;
    }
    ret = dev == DEV_CUDA ? none_result() : int_result(out, has_out, count);
done:
    views_release(&vs_);
    return ret;
}

#define T_MAX (((int64_t)1 << 32) - 1)

static PyObject *py_sketch_encode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"sketch", "idx", "val", "n", "t", "seed", "stream",
                          "status_out", NULL};
    PyObject *osk, *oidx, *oval, *on, *ot, *oseed, *ostream = NULL, *ostatus = NULL;
    BEGIN("sketch_encode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|$OO", kwl, &osk, &oidx, &oval, &on,
                                     &ot, &oseed, &ostream, &ostatus))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(sk, osk, "sketch", K_F32 | K_BF16);
    TAKE(idx, oidx, "idx", K_I32);
    TAKE(val, oval, "val", K_F32 | K_BF16);
    TAKE_STATUS(ostatus);
    int64_t n, t;
    uint64_t seed;
    CHECK(arg_range(fn, on, "n", 0, TAGC_MAX_N, &n));
    CHECK(arg_range(fn, ot, "t", 1, T_MAX, &t));
    CHECK(arg_u64(fn, oseed, "seed", &seed));
    CHECK(need_size(&vs_, val, idx->numel, 1, "idx.numel()"));
    CHECK(need_size(&vs_, sk, tagc_sketch_buckets(t), 0, "sketch_buckets(t)"));
    int dev = common_device(&vs_);
    CHECK(dev);
    if (dev == DEV_CUDA) { /* an idx outside [0, n): skipped, RANGE in status_out */
        RUN_CUDA(sk, tagc_cuda_sketch_encode_workspace_size(t, codec_dtype(sk->kind)),
                 tagc_cuda_sketch_encode(sk->data, codec_dtype(sk->kind), sk->numel,
                                         idx->data, val->data, codec_dtype(val->kind),
                                         idx->numel, n, t, seed,
                                         has_status ? status->data : NULL, ws_, wsb_,
                                         strm_));
    } else {
        RUN(tagc_sketch_encode(sk->data, codec_dtype(sk->kind), sk->numel, idx->data,
                               val->data, codec_dtype(val->kind), idx->numel, n, t, seed));
    }
    END_NONE(TAGC_ERR_RANGE,
             "idx holds a position outside [0, n)");
}

static PyObject *py_peel_decode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "sketch", "bitmap", "n", "t", "seed", "unpeeled",
                          "estimate", "count_out", "stream", NULL};
    PyObject *oout, *osk, *obm, *on, *ot, *oseed, *ounp = NULL, *oest = NULL,
             *ocnt = NULL, *ostream = NULL;
    BEGIN("peel_decode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|$OOOO", kwl, &oout, &osk, &obm,
                                     &on, &ot, &oseed, &ounp, &oest, &ocnt, &ostream))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(out, oout, "out", K_F32);
    TAKE(sk, osk, "sketch", K_F32 | K_BF16);
    TAKE(bitmap, obm, "bitmap", K_U8);
    TAKE_OPT(unp, has_unp, ounp, "unpeeled", K_I32);
    TAKE_OPT(cnt, has_cnt, ocnt, "count_out", K_I64);
    int64_t n, t;
    uint64_t seed;
    int estimate = 1;
    CHECK(arg_range(fn, on, "n", 0, TAGC_MAX_N, &n));
    CHECK(arg_range(fn, ot, "t", 1, T_MAX, &t));
    CHECK(arg_u64(fn, oseed, "seed", &seed));
    if (oest != NULL && (estimate = PyObject_IsTrue(oest)) < 0)
        goto done;
    CHECK(need_size(&vs_, out, n, 0, "n"));
    CHECK(need_size(&vs_, sk, tagc_sketch_buckets(t), 0, "sketch_buckets(t)"));
    CHECK(need_size(&vs_, bitmap, tagc_bitmap_bytes(n), 0, "bitmap_bytes(n)"));
    CHECK(scalar_out_ok(&vs_, cnt, has_cnt));
    int dev = common_device(&vs_);
    CHECK(dev);
    CHECK(cuda_needs(fn, dev, has_cnt, "count_out"));
    int64_t left = 0;
    if (dev == DEV_CUDA) {
        RUN_CUDA(out, tagc_cuda_peel_decode_workspace_size(n, t, TAGC_CUDA_PEEL_ROUNDS),
                 tagc_cuda_peel_decode(out->data, out->numel, has_unp ? unp->data : NULL,
                                       has_unp ? unp->numel : 0, cnt->data, sk->data,
                                       codec_dtype(sk->kind), bitmap->data, n, t, seed,
                                       estimate, TAGC_CUDA_PEEL_ROUNDS, ws_, wsb_, strm_));
    } else {
        RUN(tagc_peel_decode(out->data, out->numel, has_unp ? unp->data : NULL,
                             has_unp ? unp->numel : 0, &left, sk->data, codec_dtype(sk->kind),
                             bitmap->data, n, t, seed, estimate));
    }
    if (st != TAGC_OK) {
        raise_status(m, fn, st, NULL);
        goto done;
    }
    ret = dev == DEV_CUDA ? none_result() : int_result(cnt, has_cnt, left);
done:
    views_release(&vs_);
    return ret;
}

static PyObject *py_sparse_pack(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"buf", "idx", "val", "stream", NULL};
    PyObject *obuf, *oidx, *oval, *ostream = NULL;
    BEGIN("sparse_pack");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$O", kwl, &obuf, &oidx, &oval, &ostream))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(buf, obuf, "buf", K_U8);
    TAKE(idx, oidx, "idx", K_I32);
    TAKE(val, oval, "val", K_F32 | K_BF16);
    int64_t k = idx->numel;
    tagc_dtype vd = codec_dtype(val->kind);
    CHECK(need_size(&vs_, val, k, 1, "idx.numel()"));
    CHECK(need_size(&vs_, buf, tagc_sparse_bytes(k, vd), 0, "sparse_bytes(k, value_dtype)"));
    int dev = common_device(&vs_);
    CHECK(dev);
    if (dev == DEV_CUDA) {
        RUN_CUDA(buf, 0, tagc_cuda_sparse_pack(buf->data, buf->numel, idx->data, val->data,
                                               vd, k, strm_));
    } else {
        RUN(tagc_sparse_pack(buf->data, buf->numel, idx->data, val->data, vd, k));
    }
    END_NONE(TAGC_OK, NULL);
}

static PyObject *py_sparse_unpack(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "buf", "k", "value_dtype", "stream", "status_out", NULL};
    PyObject *oout, *obuf, *ok, *odt, *ostream = NULL, *ostatus = NULL;
    BEGIN("sparse_unpack");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$OO", kwl, &oout, &obuf, &ok, &odt,
                                     &ostream, &ostatus))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(out, oout, "out", K_F32);
    TAKE(buf, obuf, "buf", K_U8);
    TAKE_STATUS(ostatus);
    int64_t k;
    tagc_dtype vd;
    CHECK(arg_value_dtype(fn, odt, &vd));
    CHECK(arg_range(fn, ok, "k", 0, INT64_MAX / 8, &k));
    CHECK(need_max_n(&vs_, out));
    CHECK(need_size(&vs_, buf, tagc_sparse_bytes(k, vd), 1, "sparse_bytes(k, value_dtype)"));
    int dev = common_device(&vs_);
    CHECK(dev);
    if (dev == DEV_CUDA) { /* bad offset: out untouched, CORRUPT in status_out */
        RUN_CUDA(out, tagc_cuda_sparse_unpack_workspace_size(),
                 tagc_cuda_sparse_unpack(out->data, out->numel, buf->data, buf->numel, k, vd,
                                         has_status ? status->data : NULL, ws_, wsb_,
                                         strm_));
    } else {
        RUN(tagc_sparse_unpack(out->data, out->numel, buf->data, buf->numel, k, vd));
    }
    END_NONE(TAGC_ERR_CORRUPT,
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
    return arg_range(fn, oblock, "block", 1, TAGC_QBLOCK_MAX, block);
}

static PyObject *py_pairs_pack(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"buf", "idx", "val", "n", "coding", "stream", "status_out", NULL};
    PyObject *obuf, *oidx, *oval, *on, *oc, *ostream = NULL, *ostatus = NULL;
    BEGIN("pairs_pack");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$OO", kwl, &obuf, &oidx, &oval, &on,
                                     &oc, &ostream, &ostatus))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(buf, obuf, "buf", K_U8);
    TAKE(idx, oidx, "idx", K_I32);
    TAKE(val, oval, "val", K_F32 | K_BF16);
    TAKE_STATUS(ostatus);
    int64_t n, k = idx->numel;
    tagc_coding c;
    tagc_dtype vd = codec_dtype(val->kind);
    CHECK(arg_range(fn, on, "n", k, TAGC_MAX_N, &n));
    CHECK(arg_coding(fn, oc, &c));
    CHECK(need_size(&vs_, val, k, 1, "idx.numel()"));
    CHECK(need_size(&vs_, buf, tagc_pairs_bytes(n, k, vd, c), 0,
                    "pairs_bytes(n, k, value_dtype, coding)"));
    int dev = common_device(&vs_);
    CHECK(dev);
    if (dev == DEV_CUDA) { /* positions not ascending in [0, n): RANGE in status_out */
        RUN_CUDA(buf, tagc_cuda_pairs_pack_workspace_size(),
                 tagc_cuda_pairs_pack(buf->data, buf->numel, idx->data, val->data, vd, k, n,
                                      c, has_status ? status->data : NULL, ws_, wsb_,
                                      strm_));
    } else {
        RUN(tagc_pairs_pack(buf->data, buf->numel, idx->data, val->data, vd, k, n, c));
    }
    END_NONE(TAGC_ERR_RANGE,
             "idx must be strictly ascending "
             "positions in [0, n) (nothing written)");
}

static PyObject *py_pairs_unpack_add(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "buf", "k", "value_dtype", "coding", "stream", "status_out",
                          NULL};
    PyObject *oout, *obuf, *ok, *odt, *oc, *ostream = NULL, *ostatus = NULL;
    BEGIN("pairs_unpack_add");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$OO", kwl, &oout, &obuf, &ok, &odt,
                                     &oc, &ostream, &ostatus))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    TAKE(out, oout, "out", K_F32);
    TAKE(buf, obuf, "buf", K_U8);
    TAKE_STATUS(ostatus);
    int64_t k;
    tagc_dtype vd;
    tagc_coding c;
    CHECK(need_max_n(&vs_, out));
    CHECK(arg_range(fn, ok, "k", 0, out->numel, &k));
    CHECK(arg_value_dtype(fn, odt, &vd));
    CHECK(arg_coding(fn, oc, &c));
    CHECK(need_size(&vs_, buf, tagc_pairs_bytes(out->numel, k, vd, c), 1,
                    "pairs_bytes(out.numel(), k, value_dtype, coding)"));
    int dev = common_device(&vs_);
    CHECK(dev);
    if (dev == DEV_CUDA) { /* inconsistent message: out untouched, CORRUPT in status_out */
        RUN_CUDA(out, tagc_cuda_pairs_unpack_add_workspace_size(out->numel, k),
                 tagc_cuda_pairs_unpack_add(out->data, out->numel, buf->data, buf->numel, k,
                                            vd, c, has_status ? status->data : NULL, ws_,
                                            wsb_, strm_));
    } else {
        RUN(tagc_pairs_unpack_add(out->data, out->numel, buf->data, buf->numel, k, vd, c));
    }
    END_NONE(TAGC_ERR_CORRUPT,
             "buf is not a valid message of k pairs of a "
             "shard of out.numel() (out untouched)");
}

static PyObject *py_quant_encode(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"buf", "residual", "grad", "format", "block", "stream", NULL};
    PyObject *obuf, *ores, *ograd, *ofmt, *oblock, *ostream = NULL;
    BEGIN("quant_encode");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$O", kwl, &obuf, &ores, &ograd, &ofmt,
                                     &oblock, &ostream))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    tagc_qformat fmt;
    int64_t block;
    CHECK(arg_quant(fn, ofmt, oblock, 0, &fmt, &block));
    TAKE(buf, obuf, "buf", K_U8);
    TAKE_OPT(res, has_res, ores, "residual", K_F32 | K_BF16);
    TAKE(grad, ograd, "grad", K_F32 | K_BF16);
    int64_t n = grad->numel;
    CHECK(need_max_n(&vs_, grad));
    if (has_res)
        CHECK(need_size(&vs_, res, n, 1, "grad.numel()"));
    CHECK(need_size(&vs_, buf, tagc_quant_bytes(n, fmt, block), 0,
                    "quant_bytes(grad.numel(), format, block)"));
    int dev = common_device(&vs_);
    CHECK(dev);
    if (dev == DEV_CUDA) { /* NaN/Inf: every scale NaN, residual untouched (tagc_cuda.h) */
        RUN_CUDA(grad, tagc_cuda_quant_encode_workspace_size(),
                 tagc_cuda_quant_encode(buf->data, buf->numel, has_res ? res->data : NULL,
                                        codec_dtype(res->kind), grad->data,
                                        codec_dtype(grad->kind), n, fmt, block, ws_, wsb_,
                                        strm_));
    } else {
        RUN(tagc_quant_encode(buf->data, buf->numel, has_res ? res->data : NULL,
                              codec_dtype(res->kind), grad->data, codec_dtype(grad->kind), n,
                              fmt, block));
    }
    END_NONE(TAGC_ERR_NONFINITE,
             "grad + residual holds NaN or Inf (residual "
             "untouched)");
}

static PyObject *py_quant_decode_add(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"out", "buf", "format", "block", "stream", "status_out", NULL};
    PyObject *oout, *obuf, *ofmt, *oblock, *ostream = NULL, *ostatus = NULL;
    BEGIN("quant_decode_add");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$OO", kwl, &oout, &obuf, &ofmt, &oblock,
                                     &ostream, &ostatus))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    tagc_qformat fmt;
    int64_t block;
    CHECK(arg_quant(fn, ofmt, oblock, 0, &fmt, &block));
    TAKE(out, oout, "out", K_F32);
    TAKE(buf, obuf, "buf", K_U8);
    TAKE_STATUS(ostatus);
    CHECK(need_max_n(&vs_, out));
    CHECK(need_size(&vs_, buf, tagc_quant_bytes(out->numel, fmt, block), 1,
                    "quant_bytes(out.numel(), format, block)"));
    int dev = common_device(&vs_);
    CHECK(dev);
    if (dev == DEV_CUDA) { /* invalid code: out untouched, CORRUPT in status_out */
        RUN_CUDA(out, tagc_cuda_quant_decode_add_workspace_size(),
                 tagc_cuda_quant_decode_add(out->data, out->numel, buf->data, buf->numel, fmt,
                                            block, has_status ? status->data : NULL, ws_,
                                            wsb_, strm_));
    } else {
        RUN(tagc_quant_decode_add(out->data, out->numel, buf->data, buf->numel, fmt, block));
    }
    END_NONE(TAGC_ERR_CORRUPT,
             "buf holds a code outside the format "
             "(out untouched)");
}

/* ---- quantized weight gather ------------------------------------------- */

/* The segment lengths of a wq call: an int64 tensor (a view, on the data's
 * device: the CUDA kernels read it there) or a sequence of ints (copied into
 * vs->owned, CPU calls only; view is NULL then). */
typedef struct {
    const int64_t *len;
    int64_t n;
    view_t *view;
} segs_t;

static int arg_segs(views_t *vs, PyObject *o, segs_t *segs)
{
    memset(segs, 0, sizeof *segs);
    if (PyObject_HasAttrString(o, "__dlpack__")) {
        segs->view = view_take(vs, o, "segs", K_I64);
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
        if (arg_i64(vs->fn, PyTuple_GET_ITEM(seq, i), "segs", &vs->owned[i]) < 0) {
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
static int segs_check(views_t *vs, const segs_t *segs, int64_t *total)
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
static int segs_for(views_t *vs, const segs_t *segs, int dev, const view_t *data)
{
    int64_t total;
    if (dev == DEV_CUDA) {
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
} size_arg;

static char *const SIZE_KEYWORDS[] = {
    [SA_N] = "n", [SA_K_OF_N] = "k", [SA_K] = "k", [SA_BITS] = "bits", [SA_T] = "t",
    [SA_VDTYPE] = "value_dtype", [SA_QFORMAT] = "format", [SA_WQFORMAT] = "format",
    [SA_BLOCK] = "block", [SA_CODING] = "coding", [SA_SEGS] = "segs"};

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

enum { SZ_BITMAP, SZ_LANES, SZ_SKETCH, SZ_SPARSE, SZ_QUANT, SZ_PAIRS, SZ_CHEAPEST, SZ_WQ };

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
};

/* Checks one argument of a scalar kind into *a. */
static int size_arg_check(const char *fn, size_arg kind, PyObject *o, size_args *a)
{
    switch (kind) {
    case SA_N: return arg_range(fn, o, "n", 0, TAGC_MAX_N, &a->n);
    case SA_K_OF_N: return arg_range(fn, o, "k", 0, a->n, &a->k);
    case SA_K: return arg_range(fn, o, "k", 0, INT64_MAX / 8, &a->k);
    case SA_BITS: return arg_i64(fn, o, "bits", &a->bits) < 0 ? -1 : check_bits(fn, a->bits);
    case SA_T: return arg_range(fn, o, "t", 1, T_MAX, &a->t);
    case SA_VDTYPE: return arg_value_dtype(fn, o, &a->vd);
    case SA_QFORMAT: return arg_format(fn, o, 0, &a->fmt);
    case SA_WQFORMAT: return arg_format(fn, o, 1, &a->fmt);
    case SA_BLOCK: return arg_range(fn, o, "block", 1, TAGC_QBLOCK_MAX, &a->block);
    case SA_CODING: return arg_coding(fn, o, &a->coding);
    case SA_SEGS: break; /* size_segs(), once the cheap checks passed */
    }
    return 0;
}

/* wq_bytes' table: the size is a host number, so the table must be on the
 * CPU, where it is checked as the CPU op checks it. */
static int size_segs(views_t *vs, PyObject *o, segs_t *segs)
{
    int64_t total;
    if (arg_segs(vs, o, segs) < 0)
        return -1;
    int dev = common_device(vs);
    if (dev < 0)
        return -1;
    if (dev == DEV_CUDA) {
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
    return raise_status(m, fn, TAGC_ERR_RANGE, NULL);
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
    views_t vs;
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
    views_release(&vs);
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
    BEGIN("wq_encode");
    if (decode)
        vs_.fn = fn = "_tagc.wq_decode";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$OO", decode ? kw_dec : kw_enc, &o1, &o2,
                                     &osegs, &ofmt, &oblock, &ostream, &ostatus))
        return NULL;
    CHECK(arg_stream(fn, ostream, &stream));
    tagc_qformat fmt;
    int64_t block;
    segs_t segs;
    CHECK(arg_quant(fn, ofmt, oblock, 1, &fmt, &block));
    TAKE(first, o1, decode ? "out" : "buf", decode ? K_F32 | K_BF16 : K_U8);
    TAKE(second, o2, decode ? "buf" : "src", decode ? K_U8 : K_F32 | K_BF16);
    view_t *data = decode ? first : second, *buf = decode ? second : first;
    CHECK(arg_segs(&vs_, osegs, &segs));
    TAKE_STATUS(ostatus);
    CHECK(need_max_n(&vs_, data));
    int dev = common_device(&vs_);
    CHECK(dev);
    CHECK(segs_for(&vs_, &segs, dev, data));
    tagc_dtype dt = codec_dtype(data->kind);
    if (dev == DEV_CUDA && decode) { /* CORRUPT: out untouched; NONFINITE: NaN blocks */
        RUN_CUDA(data, tagc_cuda_wq_decode_workspace_size(segs.n),
                 tagc_cuda_wq_decode(data->data, dt, data->numel, buf->data, buf->numel,
                                     segs.len, segs.n, fmt, block,
                                     has_status ? status->data : NULL, ws_, wsb_, strm_));
    } else if (dev == DEV_CUDA) { /* a table not matching the tensors: in status_out */
        RUN_CUDA(data, tagc_cuda_wq_encode_workspace_size(segs.n),
                 tagc_cuda_wq_encode(buf->data, buf->numel, data->data, dt, data->numel,
                                     segs.len, segs.n, fmt, block,
                                     has_status ? status->data : NULL, ws_, wsb_, strm_));
    } else {
        CHECK(need_size(&vs_, buf, tagc_wq_bytes(segs.len, segs.n, fmt, block), 1,
                        "wq_bytes(segs, format, block)"));
        RUN(decode ? tagc_wq_decode(data->data, dt, data->numel, buf->data, buf->numel,
                                    segs.len, segs.n, fmt, block)
                   : tagc_wq_encode(buf->data, buf->numel, data->data, dt, data->numel,
                                    segs.len, segs.n, fmt, block));
    }
    END_NONE(st, wq_detail(st));
}

static PyObject *py_wq_encode(PyObject *m, PyObject *args, PyObject *kw)
{
    return wq_common(m, args, kw, 0);
}

static PyObject *py_wq_decode(PyObject *m, PyObject *args, PyObject *kw)
{
    return wq_common(m, args, kw, 1);
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
    KW(wq_bytes, SIG(wq_bytes, "segs, format, block",
                     "Wire size of one rank's parameter shard (segments segs) as a wq message.")),
    KW(wq_encode, SIG(wq_encode, "buf, src, segs, format, block, *, stream=0, status_out=None",
                      "One rank's parameter shard as int8/int4 block records (NaN/Inf blocks "
                      "flagged).")),
    KW(wq_decode, SIG(wq_decode, "out, buf, segs, format, block, *, stream=0, status_out=None",
                      "out = the weights of one wq message (raises NonFiniteError for a "
                      "flagged block).")),
    {"cuda_available", py_cuda_available, METH_NOARGS,
     SIG(cuda_available, "",
         "Whether the CUDA kernels are built in and a CUDA device is usable.")},
    {NULL, NULL, 0, NULL}
};

static int mod_exec(PyObject *module)
{
    mod_state *s = get_state(module);
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
        PyModule_AddIntConstant(module, "TABLES", TAGC_TABLES) < 0)
        return -1;
    return 0;
}

static int mod_traverse(PyObject *module, visitproc visit, void *arg)
{
    mod_state *s = get_state(module);
    Py_VISIT(s->nonfinite_error);
    return 0;
}

static int mod_clear(PyObject *module)
{
    mod_state *s = get_state(module);
    Py_CLEAR(s->nonfinite_error);
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
    .m_size = sizeof(mod_state),
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
