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

#include "edge_facts.h"

#include "edge_view.h"

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
    {"plan_holds", edge_plan_holds, METH_VARARGS,
     "plan_holds(PEFT layer plan, x) -> the base layer when the plan serves x now, else None"},
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
