/*
 * csrc/python/edge_view.h - a table as lora._edge sees it: the opaque view the Python layer
 * makes once per table (an entry table's arrays, or one delta held in the view itself), read
 * back into a lora_call at every call with the call's scales.  Included by edge.c.
 */

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
