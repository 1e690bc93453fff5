/*
 * csrc/python/edge.c - lora._edge: the one edge between Python and the kernels.  Every apply
 * method of every adapter kind (a LoraDelta is a table of one entry, a stack one entry of its
 * members, a bank one entry per slot, a DoRA delta a member with an epilogue, experts a routed
 * table) calls `apply` here first, with the objects it was given; `plan_run` (edge_peft.h) is
 * the short path of a PEFT LoRA Linear layer under accelerate_peft.
 *
 * Through cffi a call makes one pointer object per array and converts every argument: about
 * 0.6 us of a 1.1 us call whose kernel does nothing (scale 0).  Here the facts of an array are
 * read from the object in C (a NumPy array's struct, a tensor's DLPack export), a lora_call is
 * filled and lora_apply runs, reached through the function pointer lora._lora_cffi hands over
 * at import (one library state: the ISA choice, the team, the plans).
 *
 * `apply` takes the complete case the kernels read in place: NumPy arrays or torch tensors
 * (each of x and out either), of the op's shapes, of dtypes the kernels read, the last axis
 * contiguous and the leading axes collapsing to one stride (row-strided views such as
 * qkv[:, :d] included), out writeable (a tensor: on the CPU, no autograd leaf, without the neg
 * bit), int64 ids (NumPy or torch) and float64 scales (NumPy) of the shapes the rules allow.
 * For anything else it returns EDGE_DECLINE and the Python layer takes its checked path, which
 * names what is wrong or converts what it can, then calls `apply` again with what it made; so
 * this file holds no error messages and changes no rule.  A nonzero C status comes back with
 * the index C blamed, as (status, bad); nothing was written then.
 *
 * The stable ABI of CPython 3.9 (the wheel is cp39-abi3): METH_VARARGS, no buffer protocol
 * (in the limited API only from 3.11); a NumPy array is read through NumPy's public struct
 * accessors (PyArray_DATA and the rest: inline reads of a layout NumPy keeps across 1.x and
 * 2.x), never through its C-API table, so no import_array.  Of the library it includes lora.h
 * only: the call's numbers come from the Python layer's view of a table.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h>
#include <string.h>

#include "lora.h"

#define EDGE_DECLINE (-1) /* the Python layer's DECLINE: take the checked path */
#define EDGE_ERROR (-2)   /* a Python error to propagate */
#define EDGE_MAX_DTYPES 8
#define EDGE_MAX_NDIM 8
/* NumPy's "warn on write" flag (a deprecated-writeable view, e.g. of np.broadcast_arrays):
 * NumPy's own writeable-buffer request warns for it, so such an out takes the checked path.
 * It is not in NumPy's public headers; tests/test_edge.py pins its value against NumPy. */
#define EDGE_NPY_WARN_ON_WRITE (1u << 31)

/* the ops of `apply` (lora._apply names them) */
enum { OP_VEC, OP_BATCH, OP_ROW, OP_ROWS, OP_EXPERTS, OP_COUNT };

typedef int (*apply_fn)(const lora_call *);

typedef struct {
    PyObject *key[EDGE_MAX_DTYPES]; /* NumPy descr objects (strong references) */
    int code[EDGE_MAX_DTYPES];
    int n;
} dtype_table;

static struct {
    PyTypeObject *ndarray;
    dtype_table np;
    PyObject *int64, *float64; /* NumPy's canonical descrs of ids and position scales */
    apply_fn apply;
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

/* What an array is to the kernels: its memory, element code (a LORA_DTYPE_* for activations,
 * KIND_I64 / KIND_F64 for ids and scales), axes with their strides in elements, and what keeps
 * the memory valid through the call (a tensor's DLPack capsule), or NULL. */
#define KIND_I64 100
#define KIND_F64 101
typedef struct {
    void *ptr;
    int code, nd;
    Py_ssize_t dim[EDGE_MAX_NDIM];
    Py_ssize_t st[EDGE_MAX_NDIM];
    PyObject *keep;
} facts;

/* An exception raised while reading an object's facts: an Exception means "not this path"
 * (the checked path meets it again and names it); anything else (KeyboardInterrupt)
 * propagates. */
static int miss(void)
{
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return EDGE_DECLINE;
    }
    return EDGE_ERROR;
}

static int is_true(PyObject *r) /* 1, 0, or -1 on error; steals r */
{
    if (r == NULL)
        return -1;
    int v = r == Py_True;
    Py_DECREF(r);
    return v;
}

static int ndarray_facts(PyObject *o, int writeable, int want, facts *f)
{
    PyArrayObject *a = (PyArrayObject *)o;
    const int flags = PyArray_FLAGS(a);
    if (writeable && (!(flags & NPY_ARRAY_WRITEABLE) || ((unsigned)flags & EDGE_NPY_WARN_ON_WRITE)))
        return EDGE_DECLINE;
    PyObject *descr = (PyObject *)PyArray_DESCR(a);
    if (want == KIND_I64 || want == KIND_F64)
        f->code = descr == (want == KIND_I64 ? E.int64 : E.float64) ? want : -1;
    else
        f->code = lookup(&E.np, descr);
    f->nd = PyArray_NDIM(a);
    if (f->code < 0 || f->nd > EDGE_MAX_NDIM)
        return EDGE_DECLINE;
    const npy_intp *dims = PyArray_DIMS(a), *strides = PyArray_STRIDES(a);
    /* the item size from the code (a descr's own field moved between NumPy 1.x and 2.x) */
    const Py_ssize_t isz = f->code == KIND_I64 || f->code == KIND_F64 ? 8
                           : f->code == LORA_DTYPE_F32                ? 4
                                                                      : 2;
    for (int i = 0; i < f->nd; i++) {
        f->dim[i] = (Py_ssize_t)dims[i];
        if (strides[i] % isz)
            return EDGE_DECLINE;
        f->st[i] = (Py_ssize_t)(strides[i] / isz);
    }
    f->ptr = PyArray_DATA(a);
    return 0;
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
#define DL_INT 0
#define DL_FLOAT 2
#define DL_BFLOAT 4

static int dl_code(dl_dtype t)
{
    if (t.lanes != 1)
        return -1;
    if (t.code == DL_FLOAT)
        return t.bits == 32 ? LORA_DTYPE_F32 : t.bits == 16 ? LORA_DTYPE_F16
                                                            : t.bits == 64 ? KIND_F64 : -1;
    if (t.code == DL_INT && t.bits == 64)
        return KIND_I64;
    return t.code == DL_BFLOAT && t.bits == 16 ? LORA_DTYPE_BF16 : -1;
}

/* A plain CPU tensor's facts.  ``f->keep`` (the DLPack capsule, which holds a reference to the
 * tensor's storage) is set on success and released after the C call. */
static int tensor_facts(PyObject *t, int writeable, int want, facts *f)
{
    PyObject *cap = PyObject_CallFunctionObjArgs(E.to_dlpack, t, NULL);
    if (cap == NULL)
        return miss(); /* meta, sparse, ...: the checked path names it */
    const dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m == NULL) { /* another capsule kind (a later DLPack version): not this path */
        Py_DECREF(cap);
        return miss();
    }
    const dl_tensor *d = &m->t;
    int st = EDGE_DECLINE, v = 0;
    f->code = dl_code(d->dtype);
    const int ok_code = want == KIND_I64 ? f->code == KIND_I64
                        : want == KIND_F64 ? f->code == KIND_F64
                                           : f->code >= 0 && f->code < LORA_DTYPE_COUNT;
    if (d->device.device_type != DL_CPU || !ok_code || d->ndim < 0 || d->ndim > EDGE_MAX_NDIM
        || d->data == NULL) /* NULL: a tensor without memory (torch's zero tensors) */
        goto decline;
    f->nd = d->ndim;
    int64_t expect = 1;
    for (int i = f->nd - 1; i >= 0; i--) {
        f->dim[i] = (Py_ssize_t)d->shape[i];
        f->st[i] = (Py_ssize_t)(d->strides != NULL ? d->strides[i] : expect);
        expect *= d->shape[i];
    }
    /* the neg bit (a lazily negated view: its memory holds the values un-negated) and, for
     * out, autograd's refusal of in-place writes to a leaf that requires grad */
    v = is_true(PyObject_CallMethodObjArgs(t, E.s_is_neg, NULL));
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
    st = v < 0 ? miss() : EDGE_DECLINE;
decline:
    Py_DECREF(cap);
    return st;
}

/* an ndarray's or a plain tensor's facts; anything else declines */
static int facts_of(PyObject *o, int writeable, int want, facts *f)
{
    f->keep = NULL;
    if (Py_TYPE(o) == E.ndarray)
        return ndarray_facts(o, writeable, want, f);
    if (E.tensor != NULL && Py_TYPE(o) == E.tensor)
        return tensor_facts(o, writeable, want, f);
    return EDGE_DECLINE;
}

/* The positions of an array whose last axis holds `width` contiguous values and whose
 * leading axes (from axis `from` on, all but the last) collapse into one axis with one stride
 * (size-1 axes ignored), as NumPy's flags judge it: *n positions, *ld elements apart.  0, or
 * EDGE_DECLINE when the array is not of that form. */
static int rows_of(const facts *f, Py_ssize_t width, int64_t *n, int64_t *ld)
{
    const int nd = f->nd;
    if (nd < 1 || f->dim[nd - 1] != width)
        return EDGE_DECLINE;
    for (int i = 0; i < nd - 1; i++)
        if (f->dim[i] == 0) { /* no positions (NumPy gives such arrays any strides) */
            *n = 0, *ld = width;
            return 0;
        }
    if (width > 1 && f->st[nd - 1] != 1)
        return EDGE_DECLINE;
    /* from the innermost leading axis outwards: each steps by the stride of the ones inside
     * it times their count */
    int64_t count = 1, step = width;
    int seen = 0;
    for (int i = nd - 2; i >= 0; i--) {
        if (f->dim[i] == 1)
            continue;
        if (!seen) {
            step = f->st[i];
            if (step < width)
                return EDGE_DECLINE;
            seen = 1;
        } else if (f->st[i] != step * count) {
            return EDGE_DECLINE;
        }
        count *= f->dim[i];
    }
    *n = count, *ld = step;
    return 0;
}

/* an int64 or float64 array that is C-contiguous (NumPy's flags: size-1 axes anywhere) */
static int contiguous(const facts *f)
{
    int64_t expect = 1;
    for (int i = f->nd - 1; i >= 0; i--) {
        if (f->dim[i] != 1 && f->st[i] != expect)
            return 0;
        expect *= f->dim[i];
    }
    return 1;
}

/* a shape equal to the first k axes of another's */
static int same_dims(const Py_ssize_t *a, const Py_ssize_t *b, int k)
{
    for (int i = 0; i < k; i++)
        if (a[i] != b[i])
            return 0;
    return 1;
}

/* autograd's version counter of a tensor out about to be written, as torch's in-place ops do
 * (under grad mode only; see lora._torch.note_write) */
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

/* The Python layer's view of a table (lora._entries.EntryTable's, LoraDelta's), made once by
 * `view` below: the table part of a lora_call, and the op its epilogue data serves (-1: no
 * epilogue).  The scales come with each call: the effective scale of a one-member table as a
 * float, or (scales address, epilogue data address (0: none), ...keep). */
typedef struct {
    lora_call c;
    int epi_op;
} table_view;

typedef struct {
    int64_t n_entries, rows, cols, n_adapters, n_experts;
    const int64_t *first;
    const lora_delta *const *deltas;
    const uint8_t *epilogues;
    const int64_t *starts;
    int epi_op;
    const lora_delta *one;   /* a delta's own view: its one member, and first1 = {0, 1} */
    int64_t first1[2];
    PyObject *keep;          /* what keeps the addresses valid */
} view_box;

#define VIEW_NAME "lora._edge.view"

static void view_free(PyObject *cap)
{
    view_box *b = PyCapsule_GetPointer(cap, VIEW_NAME);
    if (b != NULL) {
        Py_XDECREF(b->keep);
        PyMem_Free(b);
    }
}

static PyObject *new_view(const view_box *v, PyObject *keep)
{
    if (v->first == NULL || v->deltas == NULL || v->n_entries < 1 || v->rows < 1 || v->cols < 1) {
        PyErr_SetString(PyExc_ValueError, "lora._edge: a table without deltas");
        return NULL;
    }
    view_box *b = PyMem_Malloc(sizeof *b);
    if (b == NULL)
        return PyErr_NoMemory();
    *b = *v;
    if (b->one != NULL) { /* its own one-member table */
        b->deltas = &b->one;
        b->first = b->first1;
    }
    b->keep = keep;
    Py_XINCREF(keep);
    PyObject *cap = PyCapsule_New(b, VIEW_NAME, view_free);
    if (cap == NULL) {
        Py_XDECREF(keep);
        PyMem_Free(b);
    }
    return cap;
}

/* view(n_entries, first, deltas, rows, cols, epilogues, epi_op, n_adapters, starts, n_experts,
 *      keep) -> an entry table's opaque view: the addresses as ints (0: none), keep what owns
 * them */
static PyObject *edge_view(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[11];
    if (!PyArg_UnpackTuple(args, "view", 11, 11, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                           &o[7], &o[8], &o[9], &o[10]))
        return NULL;
    view_box v;
    memset(&v, 0, sizeof v);
    v.n_entries = PyLong_AsLongLong(o[0]);
    v.first = PyLong_AsVoidPtr(o[1]);
    v.deltas = PyLong_AsVoidPtr(o[2]);
    v.rows = PyLong_AsLongLong(o[3]);
    v.cols = PyLong_AsLongLong(o[4]);
    v.epilogues = PyLong_AsVoidPtr(o[5]);
    v.epi_op = (int)PyLong_AsLong(o[6]);
    v.n_adapters = PyLong_AsLongLong(o[7]);
    v.starts = PyLong_AsVoidPtr(o[8]);
    v.n_experts = PyLong_AsLongLong(o[9]);
    if (PyErr_Occurred())
        return NULL;
    return new_view(&v, o[10]);
}

/* view_of_delta(delta address, rows, cols, keep) -> the view of one delta: a table of one
 * entry of one member, held in the view itself */
static PyObject *edge_view_of_delta(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *d, *r, *c, *keep;
    if (!PyArg_UnpackTuple(args, "view_of_delta", 4, 4, &d, &r, &c, &keep))
        return NULL;
    view_box v;
    memset(&v, 0, sizeof v);
    v.one = PyLong_AsVoidPtr(d);
    v.rows = PyLong_AsLongLong(r);
    v.cols = PyLong_AsLongLong(c);
    if (PyErr_Occurred())
        return NULL;
    if (v.one == NULL) {
        PyErr_SetString(PyExc_ValueError, "lora._edge: a NULL delta");
        return NULL;
    }
    v.n_entries = 1, v.first1[1] = 1, v.epi_op = -1;
    v.first = v.first1, v.deltas = &v.one; /* set again to the copy's own by new_view */
    return new_view(&v, keep);
}

static int read_view(PyObject *view, PyObject *scales, table_view *v, double *one)
{
    const view_box *b = PyCapsule_CheckExact(view) ? PyCapsule_GetPointer(view, VIEW_NAME) : NULL;
    if (b == NULL) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "lora._edge: a view (lora._edge.view) expected");
        return -1;
    }
    memset(v, 0, sizeof *v);
    lora_call *c = &v->c;
    c->n_entries = b->n_entries, c->first = b->first, c->deltas = b->deltas;
    c->rows = b->rows, c->cols = b->cols, c->epilogues = b->epilogues;
    c->n_adapters = b->n_adapters, c->starts = b->starts, c->n_experts = b->n_experts;
    v->epi_op = b->epi_op;
    if (PyFloat_Check(scales)) {
        *one = (float)PyFloat_AsDouble(scales); /* rounded once to float32, as the kernels use it */
        if (PyErr_Occurred())
            return -1;
        c->scales = one;
    } else if (PyTuple_Check(scales) && PyTuple_Size(scales) >= 2) {
        c->scales = PyLong_AsVoidPtr(PyTuple_GetItem(scales, 0));
        c->epi_data = PyLong_AsVoidPtr(PyTuple_GetItem(scales, 1));
        if (PyErr_Occurred())
            return -1;
    } else {
        PyErr_SetString(PyExc_TypeError, "lora._edge: scales must be a float or a tuple");
        return -1;
    }
    if (c->scales == NULL) {
        PyErr_SetString(PyExc_ValueError, "lora._edge: a table without scales");
        return -1;
    }
    return 0;
}

/* ids [shape of a prefix of `lead` (nlead axes), k >= 1 of them; or 0-d when `zero_ok`]:
 * their facts and positions per id.  0, or EDGE_DECLINE. */
static int ids_of(PyObject *ids, const Py_ssize_t *lead, int nlead, int zero_ok, facts *f,
                  int64_t *every)
{
    int st = facts_of(ids, 0, KIND_I64, f);
    if (st != 0)
        return st;
    if (!contiguous(f) || f->nd > nlead || (f->nd == 0 && !zero_ok)
        || !same_dims(f->dim, lead, f->nd))
        return EDGE_DECLINE;
    int64_t rest = 1, count = 1;
    for (int i = 0; i < f->nd; i++)
        count *= f->dim[i];
    for (int i = f->nd; i < nlead; i++)
        rest *= lead[i];
    *every = count ? rest : 1;
    return 0;
}

/* position scales: float64 NumPy of the ids' shape, C-contiguous */
static int pos_of(PyObject *pos, const facts *fi, facts *f)
{
    f->keep = NULL;
    if (Py_TYPE(pos) != E.ndarray)
        return EDGE_DECLINE;
    int st = ndarray_facts(pos, 0, KIND_F64, f);
    if (st != 0)
        return st;
    return f->nd == fi->nd && same_dims(f->dim, fi->dim, f->nd) && contiguous(f) ? 0
                                                                                  : EDGE_DECLINE;
}

/* the status as `apply` answers it: 0, EDGE_DECLINE, NULL (an error), or (status, bad) */
static PyObject *answer(int st, int64_t bad)
{
    if (st == EDGE_ERROR)
        return NULL;
    if (st == 0 || st == EDGE_DECLINE)
        return PyLong_FromLong(st);
    return Py_BuildValue("(iL)", st, (long long)bad);
}

/* apply(view, scales, op, x, out, ids, pos, extra, epi): see the top of this file.
 *   OP_VEC      x [cols], out [rows] (one position)
 *   OP_BATCH    x [..., cols], out [..., rows], the same leading axes (at least one)
 *   OP_ROW      x: one token id (an int), out [cols]
 *   OP_ROWS     x: token ids, int64 [...], out [..., cols]
 *   OP_EXPERTS  extra: expert ids [..., k]; out [..., k, rows]; x [..., cols] (one row per
 *               token, shared by its k slots) or [..., k, cols] (one per slot)
 * ids: None, or int64 adapter ids of a prefix of the positions' leading shape (experts: of the
 * expert ids' shape or a prefix of it); pos: None, or float64 scales of the ids' shape (only
 * with ids); epi: None, or (epilogue data address, stride) for a call with per-position scales
 * on a table with epilogues. */
static PyObject *edge_apply(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *view, *scales, *op_o, *x, *out, *ids, *pos, *extra, *epi;
    if (!PyArg_UnpackTuple(args, "apply", 9, 9, &view, &scales, &op_o, &x, &out, &ids, &pos,
                           &extra, &epi))
        return NULL;
    const long op = PyLong_AsLong(op_o);
    if (op == -1 && PyErr_Occurred())
        return NULL;
    if (op < 0 || op >= OP_COUNT) {
        PyErr_SetString(PyExc_ValueError, "lora._edge: an unknown op");
        return NULL;
    }
    table_view v;
    double one;
    if (read_view(view, scales, &v, &one) < 0)
        return NULL;
    lora_call *c = &v.c;
    int64_t bad = -1, tok1 = 0;
    c->bad = &bad;
    facts fx, fo, fi, fp, fe;
    fx.keep = fo.keep = fi.keep = fp.keep = fe.keep = NULL;
    int st = EDGE_DECLINE;
    /* an op whose epilogue data was made for another op, or per-position scales on a table
     * with epilogues without their data: the checked path */
    const int gather = op == OP_ROW || op == OP_ROWS;
    if (c->epilogues != NULL && (v.epi_op != (gather ? OP_ROWS : OP_BATCH)
                                 || (pos != Py_None && epi == Py_None)))
        goto done;
    if (epi != Py_None) {
        if (!PyTuple_Check(epi) || PyTuple_Size(epi) < 2)
            goto done;
        c->epi_data = PyLong_AsVoidPtr(PyTuple_GetItem(epi, 0));
        c->epi_stride = PyLong_AsLongLong(PyTuple_GetItem(epi, 1));
        if (PyErr_Occurred()) {
            st = miss();
            goto done;
        }
    }
    if ((st = facts_of(out, 1, -1, &fo)) != 0)
        goto done;
    st = EDGE_DECLINE;
    c->out = fo.ptr, c->out_dtype = fo.code;
    const Py_ssize_t *lead = fo.dim; /* the positions' leading axes */
    int nlead = fo.nd - 1;
    if (gather) {
        c->op = LORA_OP_ROWS;
        if (op == OP_ROW) { /* one token id (an int): out [cols] */
            if (!PyLong_CheckExact(x) || fo.nd != 1 || fo.dim[0] != c->cols
                || (fo.dim[0] > 1 && fo.st[0] != 1))
                goto done;
            int overflow = 0;
            tok1 = PyLong_AsLongLongAndOverflow(x, &overflow);
            if (overflow || (tok1 == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                goto done;
            }
            c->n = 1, c->ldo = c->cols, c->ids = &tok1;
        } else {
            if ((st = facts_of(x, 0, KIND_I64, &fx)) != 0)
                goto done;
            st = EDGE_DECLINE;
            if (!contiguous(&fx) || fx.nd < 1 || fo.nd != fx.nd + 1 || !same_dims(fx.dim, fo.dim, fx.nd)
                || rows_of(&fo, c->cols, &c->n, &c->ldo) != 0)
                goto done;
            c->ids = fx.ptr;
        }
    } else {
        if ((st = facts_of(x, 0, -1, &fx)) != 0)
            goto done;
        st = EDGE_DECLINE;
        c->x = fx.ptr, c->x_dtype = fx.code;
        int64_t nx = 0;
        if (op == OP_VEC) {
            c->op = LORA_OP_PROJECT;
            if (fx.nd != 1 || fo.nd != 1 || fx.dim[0] != c->cols || fo.dim[0] != c->rows
                || (c->cols > 1 && fx.st[0] != 1) || (c->rows > 1 && fo.st[0] != 1))
                goto done;
            c->n = 1, c->ldx = c->cols, c->ldo = c->rows;
            nlead = 0;
        } else if (op == OP_BATCH) {
            c->op = LORA_OP_PROJECT;
            if (fx.nd != fo.nd || fo.nd < 2 || !same_dims(fx.dim, fo.dim, fo.nd - 1)
                || rows_of(&fo, c->rows, &c->n, &c->ldo) != 0
                || rows_of(&fx, c->cols, &nx, &c->ldx) != 0)
                goto done;
        } else { /* OP_EXPERTS */
            c->op = LORA_OP_EXPERTS;
            if (c->n_adapters < 1 || c->starts == NULL || c->n_experts < 1)
                goto done;
            if ((st = facts_of(extra, 0, KIND_I64, &fe)) != 0)
                goto done;
            st = EDGE_DECLINE;
            const int ne = fe.nd;
            if (ne < 1 || !contiguous(&fe) || fo.nd != ne + 1 || !same_dims(fe.dim, fo.dim, ne)
                || rows_of(&fo, c->rows, &c->n, &c->ldo) != 0)
                goto done;
            if (fx.nd == ne && same_dims(fx.dim, fe.dim, ne - 1))
                c->x_every = fe.dim[ne - 1]; /* a token's row, shared by its k slots */
            else if (fx.nd == ne + 1 && same_dims(fx.dim, fe.dim, ne))
                c->x_every = 1;
            else
                goto done;
            if (rows_of(&fx, c->cols, &nx, &c->ldx) != 0)
                goto done;
            c->expert_ids = fe.ptr;
            lead = fe.dim, nlead = ne;
        }
    }
    if (ids != Py_None) {
        if (op == OP_VEC || op == OP_ROW)
            goto done;
        if (op == OP_ROWS)
            lead = fx.dim, nlead = fx.nd;
        if ((st = ids_of(ids, lead, nlead, op == OP_EXPERTS && nlead == 1, &fi, &c->ids_every)) != 0)
            goto done;
        st = EDGE_DECLINE;
        c->entry_ids = fi.ptr;
        if (pos != Py_None) {
            if ((st = pos_of(pos, &fi, &fp)) != 0)
                goto done;
            c->pos_scales = fp.ptr;
        }
    } else if (pos != Py_None) {
        goto done;
    }
    /* no positions: nothing to write, but ids and scales still get the checked path's
     * checks (a non-finite scale is refused whatever the batch) */
    st = c->n == 0 && (ids != Py_None || pos != Py_None) ? EDGE_DECLINE : 0;
    if (c->n == 0)
        goto done;
    if (Py_TYPE(out) != E.ndarray && note_write(out) < 0) {
        st = EDGE_ERROR;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    st = E.apply(c);
    Py_END_ALLOW_THREADS
done:
    Py_XDECREF(fx.keep);
    Py_XDECREF(fo.keep);
    Py_XDECREF(fi.keep);
    Py_XDECREF(fe.keep);
    if (st == EDGE_ERROR && !PyErr_Occurred())
        st = EDGE_DECLINE;
    return answer(st, bad);
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

/* setup(ndarray type, ((dtype, code), ...), int64 descr, float64 descr, lora_apply address) */
static PyObject *edge_setup(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *nd, *pairs, *i64, *f64, *fn_o;
    if (!PyArg_ParseTuple(args, "OOOOO", &nd, &pairs, &i64, &f64, &fn_o))
        return NULL;
    if (!PyType_Check(nd)) {
        PyErr_SetString(PyExc_TypeError, "lora._edge: setup(ndarray type, dtype pairs, int64, "
                                         "float64, lora_apply address)");
        return NULL;
    }
    void *fn = PyLong_AsVoidPtr(fn_o);
    if (fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "lora._edge: a NULL entry point");
        return NULL;
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
    E.apply = (apply_fn)fn;
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
    {"apply", edge_apply, METH_VARARGS,
     "apply(view, scales, op, x, out, ids, pos, extra, epi) -> 0, DECLINE or (status, bad)"},
    {"view", edge_view, METH_VARARGS,
     "view(n_entries, first, deltas, rows, cols, epilogues, epi_op, n_adapters, starts, "
     "n_experts, keep) -> a table's view"},
    {"view_of_delta", edge_view_of_delta, METH_VARARGS,
     "view_of_delta(delta address, rows, cols, keep) -> the view of one delta"},
    {"plan_run", edge_plan_run, METH_VARARGS,
     "plan_run(PEFT layer plan, x) -> the output, None (declined), or (result, base)"},
    {"setup", edge_setup, METH_VARARGS,
     "setup(ndarray, dtype pairs, int64, float64, lora_apply address)"},
    {"add_numpy_dtypes", edge_add_numpy_dtypes, METH_O, "add_numpy_dtypes(dtype pairs)"},
    {"setup_torch", edge_setup_torch, METH_VARARGS,
     "setup_torch(Tensor, to_dlpack, is_grad_enabled, version bump)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lora._edge",
    "The one edge between lora's Python layer and its kernels (see csrc/python/edge.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__edge(void)
{
    E.s_requires_grad = PyUnicode_InternFromString("requires_grad");
    E.s_is_neg = PyUnicode_InternFromString("is_neg");
    if (!E.s_requires_grad || !E.s_is_neg || plan_names() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "DECLINE", EDGE_DECLINE) < 0
                      || PyModule_AddIntConstant(m, "OP_VEC", OP_VEC) < 0
                      || PyModule_AddIntConstant(m, "OP_BATCH", OP_BATCH) < 0
                      || PyModule_AddIntConstant(m, "OP_ROW", OP_ROW) < 0
                      || PyModule_AddIntConstant(m, "OP_ROWS", OP_ROWS) < 0
                      || PyModule_AddIntConstant(m, "OP_EXPERTS", OP_EXPERTS) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
