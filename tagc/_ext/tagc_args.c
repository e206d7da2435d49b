/*
 * tagc_args.c - the argument machinery of the CPython module `_tagc`:
 * tensor arguments as checked DLPack views, scalar arguments, results and
 * statuses (tagc_args.h documents each function).  Below _tagcmodule.c, which
 * alone includes tagc_args.h; nothing here calls a codec kernel.
 */
#include "tagc_args.h"

#include <stdint.h>
#include <string.h>

/* ---- dtypes and views ------------------------------------------------- */

static const char *kind_name(unsigned k)
{
    switch (k) {
    case TAGC_K_F32: return "float32";
    case TAGC_K_BF16: return "bfloat16";
    case TAGC_K_U8: return "uint8";
    case TAGC_K_I32: return "int32";
    case TAGC_K_I64: return "int64";
    }
    return "?";
}

static unsigned dl_kind(tagc_dl_dtype d)
{
    if (d.lanes != 1)
        return 0;
    if (d.code == TAGC_DL_FLOAT && d.bits == 32) return TAGC_K_F32;
    if (d.code == TAGC_DL_BFLOAT && d.bits == 16) return TAGC_K_BF16;
    if (d.code == TAGC_DL_UINT && d.bits == 8) return TAGC_K_U8;
    if (d.code == TAGC_DL_INT && d.bits == 32) return TAGC_K_I32;
    if (d.code == TAGC_DL_INT && d.bits == 64) return TAGC_K_I64;
    return 0;
}

void tagc_py_views_release(tagc_py_views *vs)
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
    for (unsigned k = 1; k <= TAGC_K_I64; k <<= 1) {
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
static int fast_export(const tagc_py_views *vs, PyObject *obj)
{
    return vs->export_fn != NULL && (PyObject *)Py_TYPE(obj) == vs->export_type;
}

static int view_precheck(const tagc_py_views *vs, PyObject *obj, const char *name)
{
    if (!fast_export(vs, obj) && !PyObject_HasAttrString(obj, "__dlpack__")) {
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

/* obj.__dlpack__(), or the registered exporter's capsule for its type (a
 * new reference), or NULL with the producer's error re-raised as a TypeError
 * that names the argument. */
static PyObject *view_export(const tagc_py_views *vs, PyObject *obj, const char *name)
{
    PyObject *cap = fast_export(vs, obj) ? PyObject_CallOneArg(vs->export_fn, obj)
                                         : PyObject_CallMethod(obj, "__dlpack__", NULL);
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
static int view_kind_device(const tagc_py_views *vs, tagc_py_view *v, const tagc_dl_tensor *t,
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
        v->device = TAGC_DEV_CPU;
        break;
    case TAGC_DL_CUDA:
    case TAGC_DL_CUDA_MANAGED:
        v->device = TAGC_DEV_CUDA;
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
static int view_extent(const tagc_py_views *vs, tagc_py_view *v, const tagc_dl_tensor *t)
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

tagc_py_view *tagc_py_view_take(tagc_py_views *vs, PyObject *obj, const char *name,
                                unsigned allowed)
{
    if (vs->n >= TAGC_PY_MAX_VIEWS) {
        PyErr_SetString(PyExc_SystemError, "_tagc: too many tensor arguments");
        return NULL;
    }
    if (view_precheck(vs, obj, name) < 0)
        return NULL;
    PyObject *cap = view_export(vs, obj, name);
    if (cap == NULL)
        return NULL;
    /* Counted in vs at once: tagc_py_views_release() drops the capsule whatever
     * check fails next. */
    tagc_py_view *v = &vs->v[vs->n];
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

tagc_py_view *tagc_py_view_take_opt(tagc_py_views *vs, PyObject *obj, const char *name,
                                    unsigned allowed, int *present)
{
    *present = obj != NULL && obj != Py_None;
    if (*present)
        return tagc_py_view_take(vs, obj, name, allowed);
    memset(&vs->none, 0, sizeof vs->none);
    vs->none.name = name;
    return &vs->none;
}

static int64_t kind_size(unsigned k)
{
    return k == TAGC_K_I64 ? 8 : k == TAGC_K_BF16 ? 2 : k == TAGC_K_U8 ? 1 : 4;
}

int tagc_py_common_device(tagc_py_views *vs)
{
    if (vs->n == 0)
        return TAGC_DEV_CPU;
    const tagc_py_view *a = &vs->v[0];
    for (int i = 1; i < vs->n; i++) {
        const tagc_py_view *b = &vs->v[i];
        if (b->device != a->device || b->device_id != a->device_id) {
            PyErr_Format(PyExc_TypeError,
                         "%s: arguments '%s' and '%s' are on different devices",
                         vs->fn, a->name, b->name);
            return -1;
        }
    }
    for (int i = 0; i < vs->n; i++) {
        const tagc_py_view *x = &vs->v[i];
        uintptr_t x0 = (uintptr_t)x->data;
        uintptr_t x1 = x0 + (uintptr_t)(x->numel * kind_size(x->kind));
        for (int j = i + 1; j < vs->n && x1 > x0; j++) {
            const tagc_py_view *y = &vs->v[j];
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
    if (a->device == TAGC_DEV_CUDA) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s' is a CUDA tensor, but _tagc was built "
                     "without CUDA kernels (CPU tensors only)", vs->fn, a->name);
        return -1;
    }
#endif
    return a->device;
}

int tagc_py_need_size(tagc_py_views *vs, const tagc_py_view *v, int64_t need, int exact,
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

int tagc_py_need_max_n(tagc_py_views *vs, const tagc_py_view *v)
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

int tagc_py_arg_i64(const char *fn, PyObject *o, const char *name, int64_t *out)
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

int tagc_py_arg_range(const char *fn, PyObject *o, const char *name, int64_t lo, int64_t hi,
                      int64_t *out)
{
    if (tagc_py_arg_i64(fn, o, name, out) < 0)
        return -1;
    if (*out < lo || *out > hi) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be in [%lld, %lld], got %lld",
                     fn, name, (long long)lo, (long long)hi, (long long)*out);
        return -1;
    }
    return 0;
}

int tagc_py_arg_u64(const char *fn, PyObject *o, const char *name, uint64_t *out)
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

int tagc_py_arg_stream(const char *fn, PyObject *o, int64_t *s)
{
    *s = 0;
    return o == NULL || o == Py_None ? 0 : tagc_py_arg_i64(fn, o, "stream", s);
}

int tagc_py_arg_value_dtype(const char *fn, PyObject *o, tagc_dtype *out)
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

/* ---- results ----------------------------------------------------------- */

PyObject *tagc_py_raise_status(PyObject *module, const char *fn, tagc_status st,
                               const char *detail)
{
    PyObject *exc;
    switch (st) {
    case TAGC_ERR_NONFINITE: exc = tagc_py_get_state(module)->nonfinite_error; break;
    case TAGC_ERR_DTYPE: exc = PyExc_TypeError; break;
    case TAGC_ERR_NOMEM: exc = PyExc_MemoryError; break;
    case TAGC_ERR_CUDA: exc = PyExc_RuntimeError; break;
    default: exc = PyExc_ValueError; break;
    }
    PyErr_Format(exc, "%s: %s%s%s", fn, tagc_status_str(st), detail ? ": " : "",
                 detail ? detail : "");
    return NULL;
}

PyObject *tagc_py_float_result(tagc_py_view *out, int present, float f)
{
    if (!present)
        return PyFloat_FromDouble(f);
    *(float *)out->data = f;
    Py_RETURN_NONE;
}

PyObject *tagc_py_int_result(tagc_py_view *out, int present, int64_t i)
{
    if (!present)
        return PyLong_FromLongLong(i);
    *(int64_t *)out->data = i;
    Py_RETURN_NONE;
}

int tagc_py_scalar_out_ok(tagc_py_views *vs, tagc_py_view *out, int present)
{
    return present ? tagc_py_need_size(vs, out, 1, 1, "a 1-element result tensor") : 0;
}

int tagc_py_cuda_needs(const char *fn, int dev, int present, const char *name)
{
    if (dev == TAGC_DEV_CUDA && !present) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s' (a 1-element tensor on the data's device) is "
                     "required for CUDA tensors: returning a number would need a host sync",
                     fn, name);
        return -1;
    }
    return 0;
}

PyObject *tagc_py_none_result(void)
{
    Py_RETURN_NONE;
}
