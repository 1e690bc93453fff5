/*
 * csrc/python/edge_facts.h - how lora._edge reads an array: a NumPy array through NumPy's
 * public struct accessors, a torch tensor through one DLPack export, each as its memory, an
 * element code, its axes and strides (`facts`), and the layout rules the kernels take in place
 * (the last axis contiguous, the leading axes collapsing to one stride: rows_of).  Included by
 * edge.c after its state E (one extension, one state).
 */

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
