/*
 * csrc/python/edge.c - lora._edge: the decode, prefill and gather entries of a LoraDelta, and the
 * entry table's calls behind stacks, banks and adapter-set banks, as CPython functions that
 * take the NumPy arrays or torch tensors themselves.
 *
 * Through cffi a call makes one pointer object per array (ffi.from_buffer) and converts every
 * argument: about 0.6 us of a 1.1 us call whose kernel does nothing (scale 0).  Here the facts
 * of an array are read from the object in C (a NumPy array's struct, a tensor's DLPack
 * export), then lora_add / lora_add_batch / lora_add_rows / lora_apply_batch run, reached
 * through the function pointers lora._lora_cffi hands over at import (one library state: the
 * ISA choice, the team, the plans).
 *
 * plan_run (edge_peft.h) is the short path of a PEFT LoRA Linear layer under accelerate_peft.
 *
 * Each entry takes only the common case: exact ndarray or torch.Tensor types, the exact shapes,
 * C-contiguous, dtypes the kernels read in place, out writeable (a tensor: on the CPU, no
 * autograd leaf, without the neg bit).  For anything else it returns EDGE_DECLINE and the
 * Python layer takes its checked path, which names what is wrong or converts what it can; so
 * this file holds no error messages and changes no rule.  A nonzero C status is returned as
 * it is (the Python layer raises it, or retries LORA_ERR_ALIGN through the checked path).
 *
 * The stable ABI of CPython 3.9 (the wheel is cp39-abi3): METH_VARARGS, no buffer protocol
 * (in the limited API only from 3.11); a NumPy array is read through NumPy's public struct
 * accessors (PyArray_DATA and the rest: inline reads of a layout NumPy keeps across 1.x and
 * 2.x), never through its C-API table, so no import_array.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h>

#include "lora.h"
#include "kernels.h"

#define EDGE_DECLINE (-1) /* the Python layer's DECLINE: take the checked path */
#define EDGE_MAX_DTYPES 8
#define EDGE_MAX_NDIM 8
/* NumPy's "warn on write" flag (a deprecated-writeable view, e.g. of np.broadcast_arrays):
 * NumPy's own writeable-buffer request warns for it, so such an out takes the checked path.
 * It is not in NumPy's public headers; tests/test_edge.py pins its value against NumPy. */
#define EDGE_NPY_WARN_ON_WRITE (1u << 31)

typedef int (*add_fn)(const lora_delta *, float, const void *, int, void *, int);
typedef int (*add_batch_fn)(const lora_delta *, float, int64_t, const void *, int, int64_t,
                            void *, int, int64_t);
typedef int (*add_rows_fn)(const lora_delta *, float, int64_t, const int64_t *, void *, int,
                           int64_t, int64_t *);
typedef int (*apply_batch_fn)(int64_t, const int64_t *, const lora_delta *const *, const double *,
                              const int64_t *, const double *, int64_t, int64_t, int64_t, int64_t,
                              const void *, int, int64_t, void *, int, int64_t, int64_t *);

typedef struct {
    PyObject *key[EDGE_MAX_DTYPES]; /* NumPy descr / torch dtype objects (strong references) */
    int code[EDGE_MAX_DTYPES];
    int n;
} dtype_table;

static struct {
    PyTypeObject *ndarray;
    dtype_table np;
    PyObject *int64, *float64; /* NumPy's canonical descrs of adapter ids and position scales */
    add_fn add;
    add_batch_fn add_batch;
    apply_batch_fn apply_batch;
    add_rows_fn add_rows;
    /* torch: set at the first tensor the Python layer sees (import lora never imports torch) */
    PyTypeObject *tensor;
    /* torch.utils.dlpack.to_dlpack, torch.is_grad_enabled, the version bump */
    PyObject *to_dlpack, *grad_enabled, *bump;
    PyObject *s_requires_grad, *s_is_neg; /* interned names */
} E;

static int lookup(const dtype_table *t, PyObject *key)
{
    for (int i = 0; i < t->n; i++)
        if (t->key[i] == key)
            return t->code[i];
    return -1;
}

static int table_add(dtype_table *t, PyObject *key, int code)
{
    if (lookup(t, key) >= 0)
        return 0;
    if (t->n == EDGE_MAX_DTYPES || code < 0 || code >= LORA_DTYPE_COUNT) {
        PyErr_SetString(PyExc_ValueError, "lora._edge: dtype table full or code out of range");
        return -1;
    }
    Py_INCREF(key);
    t->key[t->n] = key;
    t->code[t->n++] = code;
    return 0;
}

/* One array's facts; 0 when it is the fast case, EDGE_DECLINE when not, -2 on a Python error
 * that is not the object's (propagated). */
typedef struct {
    void *ptr;
    int code, nd;
    Py_ssize_t dim[EDGE_MAX_NDIM];
    PyObject *keep; /* what keeps ptr valid through the C call, released after it; or NULL */
} facts;

static int ndarray_facts(PyObject *o, int writeable, facts *f)
{
    PyArrayObject *a = (PyArrayObject *)o;
    int flags = PyArray_FLAGS(a);
    if (!(flags & NPY_ARRAY_C_CONTIGUOUS))
        return EDGE_DECLINE;
    if (writeable && (!(flags & NPY_ARRAY_WRITEABLE) || ((unsigned)flags & EDGE_NPY_WARN_ON_WRITE)))
        return EDGE_DECLINE;
    f->code = lookup(&E.np, (PyObject *)PyArray_DESCR(a));
    f->nd = PyArray_NDIM(a);
    if (f->code < 0 || f->nd > EDGE_MAX_NDIM)
        return EDGE_DECLINE;
    const npy_intp *dims = PyArray_DIMS(a);
    for (int i = 0; i < f->nd; i++)
        f->dim[i] = (Py_ssize_t)dims[i];
    f->ptr = PyArray_DATA(a);
    return 0;
}

/* An exception raised while reading a tensor's facts: an Exception means "not this path" (the
 * checked path meets it again and names it); anything else (KeyboardInterrupt) propagates. */
static int tensor_miss(void)
{
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return EDGE_DECLINE;
    }
    return -2;
}

static int is_true(PyObject *r) /* 1, 0, or -1 on error; steals r */
{
    if (r == NULL)
        return -1;
    int v = r == Py_True;
    Py_DECREF(r);
    return v;
}

/* DLPack's ABI (the dmlc/dlpack struct layout every producer and consumer shares): what the
 * "dltensor" capsule of torch.utils.dlpack.to_dlpack points at.  One call gives a tensor's
 * memory, device, dtype, shape and strides, where reading them one by one takes five calls
 * into torch. */
typedef struct { int32_t device_type, device_id; } dl_device;
typedef struct { uint8_t code, bits; uint16_t lanes; } dl_dtype;
typedef struct {
    void *data;
    dl_device device;
    int32_t ndim;
    dl_dtype dtype;
    int64_t *shape, *strides; /* strides in elements; NULL: compact row-major */
    uint64_t byte_offset;
} dl_tensor;
typedef struct dl_managed {
    dl_tensor t;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *);
} dl_managed;
#define DL_CPU 1
#define DL_FLOAT 2
#define DL_BFLOAT 4

static int dl_code(dl_dtype t)
{
    if (t.lanes != 1)
        return -1;
    if (t.code == DL_FLOAT)
        return t.bits == 32 ? LORA_DTYPE_F32 : t.bits == 16 ? LORA_DTYPE_F16 : -1;
    return t.code == DL_BFLOAT && t.bits == 16 ? LORA_DTYPE_BF16 : -1;
}

/* A plain CPU tensor's facts.  ``f->keep`` (the DLPack capsule, which holds a reference to the
 * tensor's storage) is set on success and released after the C call. */
static int tensor_facts(PyObject *t, int writeable, facts *f)
{
    PyObject *cap = PyObject_CallFunctionObjArgs(E.to_dlpack, t, NULL);
    if (cap == NULL)
        return tensor_miss(); /* meta, sparse, ...: the checked path names it */
    const dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m == NULL) { /* another capsule kind (a later DLPack version): not this path */
        Py_DECREF(cap);
        return tensor_miss();
    }
    const dl_tensor *d = &m->t;
    int st = EDGE_DECLINE;
    f->code = dl_code(d->dtype);
    if (d->device.device_type != DL_CPU || f->code < 0 || d->ndim < 0 || d->ndim > EDGE_MAX_NDIM
        || d->data == NULL) /* NULL: a tensor without memory (torch's zero tensors) */
        goto decline;
    f->nd = d->ndim;
    int64_t expect = 1; /* C-contiguous as torch counts it: a size-1 axis has any stride */
    for (int i = f->nd - 1; i >= 0; i--) {
        f->dim[i] = (Py_ssize_t)d->shape[i];
        if (d->strides != NULL && d->shape[i] != 1 && d->strides[i] != expect)
            goto decline;
        expect *= d->shape[i];
    }
    /* the neg bit (a lazily negated view: its memory holds the values un-negated) and, for
     * out, autograd's refusal of in-place writes to a leaf that requires grad */
    int v = is_true(PyObject_CallMethodObjArgs(t, E.s_is_neg, NULL));
    if (v != 0)
        goto miss_or_decline;
    if (writeable) {
        v = is_true(PyObject_GetAttr(t, E.s_requires_grad));
        if (v != 0)
            goto miss_or_decline;
    }
    f->ptr = (char *)d->data + d->byte_offset;
    f->keep = cap;
    return 0;
miss_or_decline:
    st = v < 0 ? tensor_miss() : EDGE_DECLINE;
decline:
    Py_DECREF(cap);
    return st;
}

/* x and out of one kind (both ndarrays or both plain tensors); anything else declines.  On
 * success a tensor's facts hold a reference (``keep``, released after the C call); on failure
 * neither does. */
static int both_facts(PyObject *x, PyObject *out, facts *fx, facts *fo, int *tensors)
{
    PyTypeObject *tx = Py_TYPE(x), *to = Py_TYPE(out);
    int st;
    fx->keep = fo->keep = NULL;
    if (tx == E.ndarray && to == E.ndarray) {
        *tensors = 0;
        if ((st = ndarray_facts(out, 1, fo)) != 0)
            return st;
        return ndarray_facts(x, 0, fx);
    }
    if (E.tensor != NULL && tx == E.tensor && to == E.tensor) {
        *tensors = 1;
        if ((st = tensor_facts(out, 1, fo)) != 0)
            return st;
        if ((st = tensor_facts(x, 0, fx)) != 0)
            Py_CLEAR(fo->keep);
        return st;
    }
    return EDGE_DECLINE;
}

/* autograd's version counter of a tensor out about to be written, as torch's in-place ops do
 * (under grad mode only; see lora._arrays.note_write) */
static int note_write(PyObject *out)
{
    int on = is_true(PyObject_CallObject(E.grad_enabled, NULL));
    if (on <= 0)
        return on;
    PyObject *args = PyTuple_Pack(1, out);
    if (args == NULL)
        return -1;
    PyObject *r = PyObject_CallFunctionObjArgs(E.bump, args, NULL);
    Py_DECREF(args);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* x [..., cols] and out [..., rows] with the same leading axes (``batched``: at least one;
 * else none): the positions, or -1 when they are not the fast case */
static int64_t positions(const facts *fx, const facts *fo, int64_t rows, int64_t cols,
                         int tensors, int batched)
{
    int nd = fo->nd;
    if (fx->nd != nd || (batched ? nd < 2 : nd != 1) || fx->dim[nd - 1] != cols
        || fo->dim[nd - 1] != rows)
        return -1;
    if (tensors && (cols < 2 || rows < 2)) /* a [1] tensor: the checked path's rules */
        return -1;
    int64_t n = 1;
    for (int i = 0; i < nd - 1; i++) {
        if (fx->dim[i] != fo->dim[i])
            return -1;
        n *= fo->dim[i];
    }
    return n;
}

/* The one way of both entries: (delta address, scale, x, out) -> the C status, EDGE_DECLINE, or
 * NULL with a Python error (bad arguments from the Python layer, an interrupt).  ``batched``:
 * x [..., cols] and out [..., rows] with the same leading axes (at least one), else x [cols]
 * and out [rows]. */
/* A LoraDelta entry's (delta address, scale, x or ids, out): the delta and the scale, or NULL
 * with a Python error (the arguments the Python layer passes, checked for a NULL address). */
static const lora_delta *delta_args(PyObject *args, double *sd)
{
    if (PyTuple_Size(args) != 4) {
        PyErr_SetString(PyExc_TypeError, "lora._edge: expected (delta address, scale, x or ids, out)");
        return NULL;
    }
    const lora_delta *d = (const lora_delta *)PyLong_AsVoidPtr(PyTuple_GetItem(args, 0));
    *sd = PyFloat_AsDouble(PyTuple_GetItem(args, 1));
    if ((d == NULL || *sd == -1.0) && PyErr_Occurred())
        return NULL;
    if (d == NULL)
        PyErr_SetString(PyExc_ValueError, "lora._edge: a NULL delta");
    return d;
}

static PyObject *run(PyObject *args, int batched)
{
    double sd;
    const lora_delta *d = delta_args(args, &sd);
    if (d == NULL)
        return NULL;
    PyObject *x = PyTuple_GetItem(args, 2), *out = PyTuple_GetItem(args, 3);
    facts fx, fo;
    int tensors = 0, st = both_facts(x, out, &fx, &fo, &tensors);
    if (st != 0)
        return st == -2 ? NULL : PyLong_FromLong(st);
    int64_t n = positions(&fx, &fo, d->rows, d->cols, tensors, batched);
    st = EDGE_DECLINE;
    if (n < 0)
        goto done;
    st = 0;
    if (n == 0)
        goto done;
    if (tensors && note_write(out) < 0) {
        st = -2;
        goto done;
    }
    float s = (float)sd; /* what cffi does with a float argument */
    Py_BEGIN_ALLOW_THREADS
    st = batched ? E.add_batch(d, s, n, fx.ptr, fx.code, d->cols, fo.ptr, fo.code, d->rows)
                 : E.add(d, s, fx.ptr, fx.code, fo.ptr, fo.code);
    Py_END_ALLOW_THREADS
done:
    Py_XDECREF(fx.keep);
    Py_XDECREF(fo.keep);
    return st == -2 ? NULL : PyLong_FromLong(st);
}

/* add_to(delta address, scale, x, out) -> status: decode */
static PyObject *edge_add(PyObject *self, PyObject *args)
{
    (void)self;
    return run(args, 0);
}

/* add_batch_to(delta address, scale, x, out) -> status: prefill, any leading axes */
static PyObject *edge_add_batch(PyObject *self, PyObject *args)
{
    (void)self;
    return run(args, 1);
}

/* add_rows(delta address, scale, ids, out) -> status: the embedding gathers of a LoraDelta.
 * ids: an exact int in [0, rows) with out [cols] (add_row_to), or an int64 C-contiguous ndarray
 * of at least one axis with out [*ids.shape, cols] (add_rows_to); out a C-contiguous ndarray or
 * plain CPU tensor of a dtype the kernels write.  Anything else declines; so does an id out of
 * range (lora_add_rows checks every id before its first write, and the checked path then names
 * the id and its position). */
static PyObject *edge_add_rows(PyObject *self, PyObject *args)
{
    (void)self;
    double sd;
    const lora_delta *d = delta_args(args, &sd);
    if (d == NULL)
        return NULL;
    PyObject *ids = PyTuple_GetItem(args, 2), *out = PyTuple_GetItem(args, 3);
    facts fo;
    fo.keep = NULL;
    int tensors = 0, st;
    if (Py_TYPE(out) == E.ndarray)
        st = ndarray_facts(out, 1, &fo);
    else if (E.tensor != NULL && Py_TYPE(out) == E.tensor)
        st = tensor_facts(out, 1, &fo), tensors = 1;
    else
        st = EDGE_DECLINE;
    if (st != 0)
        return st == -2 ? NULL : PyLong_FromLong(st);
    int64_t one = 0, n = 1;
    const int64_t *idp = &one;
    st = EDGE_DECLINE;
    if (PyLong_CheckExact(ids)) { /* add_row_to: one id, out [cols] */
        int overflow = 0;
        const long long r = PyLong_AsLongLongAndOverflow(ids, &overflow);
        if (overflow || r < 0 || r >= d->rows || fo.nd != 1 || fo.dim[0] != d->cols)
            goto done;
        one = (int64_t)r;
    } else if (Py_TYPE(ids) == E.ndarray) { /* add_rows_to: out [*ids.shape, cols] */
        PyArrayObject *v = (PyArrayObject *)ids;
        const int nd = PyArray_NDIM(v);
        if ((PyObject *)PyArray_DESCR(v) != E.int64 || !(PyArray_FLAGS(v) & NPY_ARRAY_C_CONTIGUOUS)
            || nd < 1 || fo.nd != nd + 1 || fo.dim[nd] != d->cols)
            goto done;
        const npy_intp *dims = PyArray_DIMS(v);
        for (int i = 0; i < nd; i++) {
            if (dims[i] != fo.dim[i])
                goto done;
            n *= dims[i];
        }
        idp = PyArray_DATA(v);
    } else {
        goto done;
    }
    if (tensors && d->cols < 2) /* a [1] tensor: the checked path's rules */
        goto done;
    st = 0;
    if (n == 0)
        goto done;
    if (tensors && note_write(out) < 0) {
        st = -2;
        goto done;
    }
    const float s = (float)sd;
    Py_BEGIN_ALLOW_THREADS
    st = E.add_rows(d, s, n, idp, fo.ptr, fo.code, d->cols, NULL);
    Py_END_ALLOW_THREADS
    if (st == LORA_ERR_INDEX) /* nothing written: the checked path names the id */
        st = EDGE_DECLINE;
done:
    Py_XDECREF(fo.keep);
    return st == -2 ? NULL : PyLong_FromLong(st);
}

/* An exact 1-D C-contiguous ndarray of `n` elements of NumPy's canonical `descr`: its data, or
 * NULL (not this path). */
static const void *vector_of(PyObject *a, PyObject *descr, Py_ssize_t n)
{
    if (Py_TYPE(a) != E.ndarray)
        return NULL;
    PyArrayObject *v = (PyArrayObject *)a;
    if ((PyObject *)PyArray_DESCR(v) != descr || PyArray_NDIM(v) != 1 || PyArray_DIMS(v)[0] != n
        || !(PyArray_FLAGS(v) & NPY_ARRAY_C_CONTIGUOUS))
        return NULL;
    return PyArray_DATA(v);
}

/* apply_batch(table, scales, x, out, ids, pos, batched) -> status: an entry table's call
 * (banks, stacks, adapter sets); ``batched`` false: a decode, x [cols] and out [rows], without
 * ids.  table: (n_kernel entries, first address, deltas address,
 * rows, cols, ...what keeps them alive); scales: (double[] address, what keeps it alive);
 * x [..., cols], out [..., rows] as add_batch_to; ids None or int64 [lead[0]] (one id per
 * leading row, repeated over the other leading axes: a sequence's adapter), pos None or float64
 * of the ids' shape (only with ids).  A nonzero status is returned without the position C
 * blamed: the Python layer repeats the call on its own path, which raises with it. */
static PyObject *edge_apply_batch(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *tab, *sc, *x, *out, *ids, *pos, *batched_o;
    if (!PyArg_UnpackTuple(args, "apply_batch", 7, 7, &tab, &sc, &x, &out, &ids, &pos, &batched_o))
        return NULL;
    int batched = PyObject_IsTrue(batched_o);
    if (batched < 0)
        return NULL;
    if (!PyTuple_Check(tab) || PyTuple_Size(tab) < 5 || !PyTuple_Check(sc) || PyTuple_Size(sc) < 1) {
        PyErr_SetString(PyExc_TypeError, "lora._edge: apply_batch(table tuple, scales tuple, ...)");
        return NULL;
    }
    int64_t n_kernel = PyLong_AsLongLong(PyTuple_GetItem(tab, 0));
    const int64_t *first = PyLong_AsVoidPtr(PyTuple_GetItem(tab, 1));
    const lora_delta *const *deltas = PyLong_AsVoidPtr(PyTuple_GetItem(tab, 2));
    int64_t rows = PyLong_AsLongLong(PyTuple_GetItem(tab, 3));
    int64_t cols = PyLong_AsLongLong(PyTuple_GetItem(tab, 4));
    const double *scales = PyLong_AsVoidPtr(PyTuple_GetItem(sc, 0));
    if (PyErr_Occurred())
        return NULL;
    if (first == NULL || deltas == NULL || scales == NULL || n_kernel < 1 || rows < 1 || cols < 1) {
        PyErr_SetString(PyExc_ValueError, "lora._edge: apply_batch: a table without deltas");
        return NULL;
    }
    facts fx, fo;
    int tensors = 0, st = both_facts(x, out, &fx, &fo, &tensors);
    if (st != 0)
        return st == -2 ? NULL : PyLong_FromLong(st);
    int64_t n = positions(&fx, &fo, rows, cols, tensors, batched), every = 1;
    const int64_t *idp = NULL;
    const double *posp = NULL;
    st = EDGE_DECLINE;
    if (n < 0)
        goto done;
    if (ids != Py_None) {
        if (!batched)
            goto done;
        idp = vector_of(ids, E.int64, fo.dim[0]);
        if (idp == NULL)
            goto done;
        every = fo.dim[0] ? n / fo.dim[0] : 1;
        if (pos != Py_None && (posp = vector_of(pos, E.float64, fo.dim[0])) == NULL)
            goto done;
    } else if (pos != Py_None) {
        goto done;
    }
    if (n == 0) /* no positions: the Python path still checks the ids' scales (nan, inf) */
        goto done;
    if (tensors && note_write(out) < 0) {
        st = -2;
        goto done;
    }
    int64_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    st = E.apply_batch(n_kernel, first, deltas, scales, idp, posp, every, rows, cols, n, fx.ptr,
                       fx.code, cols, fo.ptr, fo.code, rows, &bad);
    Py_END_ALLOW_THREADS
done:
    Py_XDECREF(fx.keep);
    Py_XDECREF(fo.keep);
    return st == -2 ? NULL : PyLong_FromLong(st);
}

#include "edge_peft.h"

static int add_pairs(dtype_table *t, PyObject *pairs)
{
    if (!PyTuple_Check(pairs)) {
        PyErr_SetString(PyExc_TypeError, "lora._edge: dtype pairs must be a tuple");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_Size(pairs); i++) {
        PyObject *p = PyTuple_GetItem(pairs, i);
        if (!PyTuple_Check(p) || PyTuple_Size(p) != 2) {
            PyErr_SetString(PyExc_TypeError, "lora._edge: a dtype pair is (dtype, code)");
            return -1;
        }
        long code = PyLong_AsLong(PyTuple_GetItem(p, 1));
        if (code == -1 && PyErr_Occurred())
            return -1;
        if (table_add(t, PyTuple_GetItem(p, 0), (int)code) < 0)
            return -1;
    }
    return 0;
}

/* setup(ndarray type, ((dtype, code), ...), int64 descr, float64 descr,
 *       (lora_add, lora_add_batch, lora_apply_batch, lora_add_rows addresses)) */
static PyObject *edge_setup(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *nd, *pairs, *i64, *f64, *fns;
    if (!PyArg_ParseTuple(args, "OOOOO", &nd, &pairs, &i64, &f64, &fns))
        return NULL;
    if (!PyType_Check(nd) || !PyTuple_Check(fns) || PyTuple_Size(fns) != 4) {
        PyErr_SetString(PyExc_TypeError, "lora._edge: setup(ndarray type, dtype pairs, int64, "
                                         "float64, (four entry addresses))");
        return NULL;
    }
    void *fn[4];
    for (int i = 0; i < 4; i++) {
        fn[i] = PyLong_AsVoidPtr(PyTuple_GetItem(fns, i));
        if (fn[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "lora._edge: a NULL entry point");
            return NULL;
        }
    }
    if (add_pairs(&E.np, pairs) < 0)
        return NULL;
    PyObject **slot[3] = {(PyObject **)&E.ndarray, &E.int64, &E.float64};
    PyObject *val[3] = {nd, i64, f64};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(val[i]);
        Py_XDECREF(*slot[i]);
        *slot[i] = val[i];
    }
    E.add = (add_fn)fn[0];
    E.add_batch = (add_batch_fn)fn[1];
    E.apply_batch = (apply_batch_fn)fn[2];
    E.add_rows = (add_rows_fn)fn[3];
    Py_RETURN_NONE;
}

/* add_numpy_dtypes(((dtype, code), ...)): a dtype object that joined the fast paths later (a
 * package's dtype, seen at the first array of it) */
static PyObject *edge_add_numpy_dtypes(PyObject *self, PyObject *pairs)
{
    (void)self;
    if (add_pairs(&E.np, pairs) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* setup_torch(Tensor type, torch.utils.dlpack.to_dlpack, torch.is_grad_enabled, version bump) */
static PyObject *edge_setup_torch(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *tt, *fn[3];
    if (!PyArg_ParseTuple(args, "OOOO", &tt, &fn[0], &fn[1], &fn[2]))
        return NULL;
    if (!PyType_Check(tt)) {
        PyErr_SetString(PyExc_TypeError, "lora._edge: the torch.Tensor type expected");
        return NULL;
    }
    for (int i = 0; i < 3; i++)
        if (!PyCallable_Check(fn[i])) {
            PyErr_SetString(PyExc_TypeError, "lora._edge: a callable expected");
            return NULL;
        }
    if (E.tensor != NULL) /* once per process: torch's objects live as long as torch */
        Py_RETURN_NONE;
    PyObject **slot[3] = {&E.to_dlpack, &E.grad_enabled, &E.bump};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(fn[i]);
        *slot[i] = fn[i];
    }
    Py_INCREF(tt);
    E.tensor = (PyTypeObject *)tt;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"add_to", edge_add, METH_VARARGS, "add_to(delta address, scale, x, out) -> C status"},
    {"add_batch_to", edge_add_batch, METH_VARARGS,
     "add_batch_to(delta address, scale, x, out) -> C status"},
    {"apply_batch", edge_apply_batch, METH_VARARGS,
     "apply_batch(table, scales, x, out, ids, pos, batched) -> C status"},
    {"add_rows", edge_add_rows, METH_VARARGS,
     "add_rows(delta address, scale, ids (an int or int64 ndarray), out) -> C status"},
    {"plan_run", edge_plan_run, METH_VARARGS,
     "plan_run(PEFT layer plan, x) -> the output, None (declined), or (result, base)"},
    {"setup", edge_setup, METH_VARARGS,
     "setup(ndarray, dtype pairs, int64, float64, (lora_add, lora_add_batch, lora_apply_batch, "
     "lora_add_rows))"},
    {"add_numpy_dtypes", edge_add_numpy_dtypes, METH_O, "add_numpy_dtypes(dtype pairs)"},
    {"setup_torch", edge_setup_torch, METH_VARARGS,
     "setup_torch(Tensor, to_dlpack, is_grad_enabled, version bump)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lora._edge",
    "The entries of a LoraDelta that take NumPy arrays and torch tensors in C "
    "(see csrc/python/edge.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__edge(void)
{
    E.s_requires_grad = PyUnicode_InternFromString("requires_grad");
    E.s_is_neg = PyUnicode_InternFromString("is_neg");
    if (!E.s_requires_grad || !E.s_is_neg || plan_names() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "DECLINE", EDGE_DECLINE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
