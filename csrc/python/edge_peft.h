/*
 * csrc/python/edge_peft.h - lora._edge's plan_run: the short path of a PEFT LoRA Linear layer
 * under accelerate_peft (lora._accel_lora.Plan), in C.
 *
 * At batch-1 decode a layer's call is mostly the checks that PEFT's state has not moved since
 * the plan was made (active adapters, merge and disable flags, hooks, the adapter modules and
 * their parameters, the scaling) and then one kernel call.  Between two layers the base model
 * streams megabytes of weights through the caches, so these checks run with cold caches; in
 * Python each attribute read is a chain of dependent lookups through the interpreter.  Here the
 * same reads are a few C calls each, in the order of Plan.run, with the same rules.
 *
 * A plan serves either the layer's active adapters (summed in order, one stack) or one mixed
 * batch of PEFT's adapter_names (row b on its own adapter, through the entry table's ids: the
 * call the Python mixed path makes).
 *
 * plan_run(plan, x) answers
 *   the layer's output    the base layer ran and the LoRA term was added in place;
 *   None                  declined before the base layer ran: the Python plan takes the call
 *                         from its start (its checks then find what moved, or grad mode, or an
 *                         x this path does not take);
 *   (result, base)        the base layer ran (once: hooks may count calls), but its result is
 *                         not the fast case, or C refused the call: the Python plan's tail
 *                         takes it from there and raises the precise error.
 * The plan tuple is built by Plan.__init__ (PLAN_* below are its fields) and holds what keeps
 * the C call's memory alive.  Grad mode declines here: the Python plan checks what autograd
 * records and bumps the version counter.  Included by edge.c (one extension, one state E).
 */

enum {
    PLAN_MODULE,       /* the PEFT layer */
    PLAN_ACTIVE,       /* a copy of its _active_adapter when the plan was made (compared by ==:
                          PEFT keeps the caller's list, which may change in place) */
    PLAN_NAMES,        /* tuple of adapter names */
    PLAN_MODS,         /* tuple of (lora_A[a], lora_B[a], lora_dropout[a]) */
    PLAN_PARAMS,       /* tuple of (A weight, B weight) parameters */
    PLAN_KEYS,         /* tuple of the views' keys (see same_tensor) */
    PLAN_CODES,        /* tuple of (A dtype code, B dtype code) */
    PLAN_SCALINGS,     /* tuple of the scaling values */
    PLAN_NDIM,         /* x's number of axes */
    PLAN_ROWS,
    PLAN_COLS,
    PLAN_HOOKS,        /* torch.nn.modules.module: where torch keeps global module hooks */
    PLAN_DELTA,        /* one adapter: its delta's address (lora_add_batch), else 0 */
    PLAN_SCALE,        /* that delta's scale (a float, rounded once to float32 by the call) */
    PLAN_TABLE,        /* the entry table's view for lora._edge: (n_kernel, first address,
                          deltas address, ...) */
    PLAN_SCALES,       /* the table's scales as (address, array) */
    PLAN_IDS,          /* a mixed batch: int64 ndarray [x.shape[0]], row b's entry (-1: none);
                          else None */
    PLAN_ABSENT,       /* a mixed batch's adapter names this layer does not hold (still absent) */
    PLAN_KEEP,         /* the entry table: it owns the deltas behind the addresses */
    PLAN_TYPES,        /* tuple of (type(lora_A[a]), type(lora_B[a]), type(lora_dropout[a])) */
    PLAN_FIELDS
};

static struct {
    PyObject *dict, *active, *disable, *merged, *training, *modules, *base_layer, *lora_a,
        *lora_b, *dropout, *fwd_hooks, *fwd_pre_hooks, *parameters, *weight, *p,
        *scaling, *g_fwd_hooks, *g_fwd_pre_hooks, *forward, *bias;
} PN;

static int plan_names(void)
{
    struct { PyObject **slot; const char *s; } n[] = {
        {&PN.dict, "__dict__"}, {&PN.active, "_active_adapter"},
        {&PN.disable, "_disable_adapters"}, {&PN.merged, "merged_adapters"},
        {&PN.training, "training"}, {&PN.modules, "_modules"}, {&PN.base_layer, "base_layer"},
        {&PN.lora_a, "lora_A"}, {&PN.lora_b, "lora_B"}, {&PN.dropout, "lora_dropout"},
        {&PN.fwd_hooks, "_forward_hooks"}, {&PN.fwd_pre_hooks, "_forward_pre_hooks"},
        {&PN.parameters, "_parameters"}, {&PN.weight, "weight"}, {&PN.p, "p"},
        {&PN.scaling, "scaling"}, {&PN.g_fwd_hooks, "_global_forward_hooks"},
        {&PN.g_fwd_pre_hooks, "_global_forward_pre_hooks"}, {&PN.forward, "forward"},
        {&PN.bias, "bias"},
    };
    for (size_t i = 0; i < sizeof n / sizeof n[0]; i++)
        if ((*n[i].slot = PyUnicode_InternFromString(n[i].s)) == NULL)
            return -1;
    return 0;
}

/* 0: go on; EDGE_DECLINE: not this path; -2: a Python error to propagate.  An exception raised
 * by a read means "not this path" (the Python plan meets it again), except a non-Exception
 * (KeyboardInterrupt), which propagates. */
static int plan_miss(void)
{
    return PyErr_Occurred() ? tensor_miss() : EDGE_DECLINE;
}

/* 1 when attribute `name` of `o` is truthy (a hook dict, a flag), 0 when not, or a miss */
static int attr_true(PyObject *o, PyObject *name, int *miss)
{
    PyObject *v = PyObject_GetAttr(o, name);
    int t = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    if (t < 0)
        *miss = plan_miss();
    return t;
}

/* Parameter i (0: A, 1: B) of an adapter still holds what the plan's view of it reads: `key`
 * is the view's (A address, B address, A dtype, B dtype, A shape, B shape, A strides, B
 * strides), `code` the dtype's code.  Read from one DLPack export; a stride counts only on an
 * axis longer than 1 (the view reads no other, and exports may normalise those). */
static int same_tensor(PyObject *p, PyObject *key, int i, PyObject *code, int *miss)
{
    PyObject *cap = PyObject_CallFunctionObjArgs(E.to_dlpack, p, NULL);
    if (cap == NULL) {
        *miss = plan_miss();
        return 0;
    }
    const dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
    int same = 0;
    if (m != NULL && PyTuple_Check(key) && PyTuple_Size(key) == 8) {
        const dl_tensor *d = &m->t;
        PyObject *shape = PyTuple_GetItem(key, 4 + i), *strides = PyTuple_GetItem(key, 6 + i);
        same = d->device.device_type == DL_CPU && PyTuple_Check(shape) && PyTuple_Check(strides)
               && PyTuple_Size(shape) == d->ndim && PyTuple_Size(strides) == d->ndim
               && PyLong_AsVoidPtr(PyTuple_GetItem(key, i)) == (char *)d->data + d->byte_offset
               && PyLong_AsLong(code) == dl_code(d->dtype);
        int64_t expect = 1;
        for (int k = d->ndim - 1; same && k >= 0; k--) {
            const int64_t st = d->strides ? d->strides[k] : expect;
            same = PyLong_AsLongLong(PyTuple_GetItem(shape, k)) == d->shape[k]
                   && (d->shape[k] == 1 || PyLong_AsLongLong(PyTuple_GetItem(strides, k)) == st);
            expect *= d->shape[k];
        }
    }
    Py_DECREF(cap);
    if (PyErr_Occurred()) {
        *miss = plan_miss();
        return 0;
    }
    return same;
}

/* dict[key] (borrowed) where dict is attribute `name` of `o`; NULL (and *miss) when absent */
static PyObject *attr_item(PyObject *o, PyObject *name, PyObject *key, int *miss)
{
    PyObject *d = PyObject_GetAttr(o, name);
    PyObject *v = d != NULL && PyDict_Check(d) ? PyDict_GetItemWithError(d, key) : NULL;
    Py_XDECREF(d); /* the object keeps its dict, and the dict its values */
    if (v == NULL)
        *miss = plan_miss();
    return v;
}

/* a module without forward hooks or pre-hooks of its own: 1, or 0 (and maybe *miss) */
static int hook_free(PyObject *mod, int *miss)
{
    return attr_true(mod, PN.fwd_hooks, miss) == 0 && attr_true(mod, PN.fwd_pre_hooks, miss) == 0;
}

/* a module still of the type the plan recorded, without a forward set on the instance, and (a
 * factor: `factor`) without a bias (its bias parameter None, no instance attribute over it):
 * 1, or 0 (and maybe *miss).  PEFT's forward calls the
 * module, so any of these would make it compute something else. */
static int plain_module(PyObject *mod, PyObject *type, int factor, int *miss)
{
    if ((PyObject *)Py_TYPE(mod) != type)
        return 0;
    PyObject *d = PyObject_GetAttr(mod, PN.dict);
    int own = d != NULL && PyDict_Check(d) ? PyDict_Contains(d, PN.forward) : -1;
    if (own == 0 && factor) /* an instance attribute shadows the (None) bias parameter */
        own = PyDict_Contains(d, PN.bias);
    Py_XDECREF(d);
    if (own != 0) {
        if (own < 0)
            *miss = plan_miss();
        return 0;
    }
    return !factor || attr_item(mod, PN.parameters, PN.bias, miss) == Py_None;
}

/* the checks of Plan.run before its base call, in its order: 0 with *base (a new reference),
 * EDGE_DECLINE, or -2.  What it reads from a dict it holds by a strong reference while it
 * calls anything that might run Python code. */
static int plan_check(PyObject *plan, PyObject **base)
{
    PyObject *m = PyTuple_GetItem(plan, PLAN_MODULE), *d = PyObject_GetAttr(m, PN.dict);
    PyObject *modules = NULL, *b = NULL, *scaling = NULL;
    int miss = EDGE_DECLINE;
    *base = NULL;
    if (d == NULL || !PyDict_Check(d))
        goto out;
    /* the active adapters (by value), the disable and merge flags */
    PyObject *v = PyDict_GetItemWithError(d, PN.active);
    if (v == NULL && PyErr_Occurred())
        goto out;
    Py_INCREF(v = v == NULL ? Py_None : v);
    int same = PyObject_RichCompareBool(v, PyTuple_GetItem(plan, PLAN_ACTIVE), Py_EQ);
    Py_DECREF(v);
    if (same != 1)
        goto out;
    PyObject *flags[2] = {PN.disable, PN.merged};
    for (int i = 0; i < 2; i++) {
        v = PyDict_GetItemWithError(d, flags[i]);
        int t = v == NULL ? (PyErr_Occurred() ? -1 : 0) : PyObject_IsTrue(v);
        if (t != 0)
            goto out;
    }
    modules = PyDict_GetItemWithError(d, PN.modules);
    Py_XINCREF(modules);
    b = modules != NULL && PyDict_Check(modules) ? PyDict_GetItemWithError(modules, PN.base_layer)
                                                 : NULL;
    Py_XINCREF(b);
    if (b == NULL)
        goto out;
    /* autograd: the Python plan's rules (what records, the version counter) */
    int grad = is_true(PyObject_CallObject(E.grad_enabled, NULL));
    if (grad != 0)
        goto out;
    PyObject *g = PyTuple_GetItem(plan, PLAN_HOOKS);
    if (attr_true(g, PN.g_fwd_hooks, &miss) != 0 || attr_true(g, PN.g_fwd_pre_hooks, &miss) != 0)
        goto out;
    /* the adapters' modules (the same objects, of the same types, with no hooks and no forward
     * of their own, the factors without a bias; a dropout in eval mode, or with p = 0),
     * parameters (the same objects on the same memory, of the same dtype, shape and strides)
     * and scaling */
    PyObject *sub[3] = {PN.lora_a, PN.lora_b, PN.dropout}, *dicts[3];
    for (int i = 0; i < 3; i++) {
        PyObject *md = PyDict_GetItemWithError(modules, sub[i]);
        dicts[i] = md != NULL ? PyObject_GetAttr(md, PN.modules) : NULL;
        if (dicts[i] == NULL || !PyDict_Check(dicts[i])) {
            for (int k = 0; k <= i; k++)
                Py_XDECREF(dicts[k]);
            goto out;
        }
    }
    PyObject *names = PyTuple_GetItem(plan, PLAN_NAMES), *mods = PyTuple_GetItem(plan, PLAN_MODS);
    PyObject *params = PyTuple_GetItem(plan, PLAN_PARAMS), *keys = PyTuple_GetItem(plan, PLAN_KEYS);
    PyObject *codes = PyTuple_GetItem(plan, PLAN_CODES);
    PyObject *scalings = PyTuple_GetItem(plan, PLAN_SCALINGS);
    PyObject *types = PyTuple_GetItem(plan, PLAN_TYPES);
    scaling = PyDict_GetItemWithError(d, PN.scaling);
    Py_XINCREF(scaling);
    int ok = scaling != NULL && PyDict_Check(scaling);
    for (Py_ssize_t q = 0; ok && q < PyTuple_Size(names); q++) {
        PyObject *a = PyTuple_GetItem(names, q), *mq = PyTuple_GetItem(mods, q);
        PyObject *pq = PyTuple_GetItem(params, q), *kq = PyTuple_GetItem(keys, q);
        PyObject *cq = PyTuple_GetItem(codes, q), *tq = PyTuple_GetItem(types, q);
        ok = tq != NULL && PyTuple_Check(tq) && PyTuple_Size(tq) == 3;
        for (int i = 0; ok && i < 3; i++) {
            PyObject *mod = PyTuple_GetItem(mq, i);
            ok = PyDict_GetItemWithError(dicts[i], a) == mod && hook_free(mod, &miss)
                 && plain_module(mod, PyTuple_GetItem(tq, i), i < 2, &miss);
        }
        if (ok) { /* training: only a dropout with p = 0, or without p (nn.Identity), is a no-op */
            PyObject *md = PyTuple_GetItem(mq, 2);
            int tr = attr_true(md, PN.training, &miss);
            if (tr < 0) {
                ok = 0;
            } else if (tr == 1) {
                PyObject *pv = PyObject_GetAttr(md, PN.p);
                if (pv == NULL) {
                    if (PyErr_ExceptionMatches(PyExc_AttributeError))
                        PyErr_Clear();
                    else
                        ok = 0;
                } else {
                    ok = PyObject_IsTrue(pv) == 0;
                    Py_DECREF(pv);
                }
            }
        }
        for (int i = 0; ok && i < 2; i++) {
            PyObject *p = PyTuple_GetItem(pq, i);
            ok = attr_item(PyTuple_GetItem(mq, i), PN.parameters, PN.weight, &miss) == p
                 && same_tensor(p, kq, i, PyTuple_GetItem(cq, i), &miss);
        }
        if (ok) {
            PyObject *s = PyDict_GetItemWithError(scaling, a);
            Py_XINCREF(s);
            ok = s != NULL && PyObject_RichCompareBool(s, PyTuple_GetItem(scalings, q), Py_EQ) == 1;
            Py_XDECREF(s);
        }
    }
    PyObject *absent = PyTuple_GetItem(plan, PLAN_ABSENT);
    for (Py_ssize_t q = 0; ok && q < PyTuple_Size(absent); q++)
        ok = PyDict_GetItemWithError(dicts[0], PyTuple_GetItem(absent, q)) == NULL
             && !PyErr_Occurred();
    for (int i = 0; i < 3; i++)
        Py_DECREF(dicts[i]);
    if (!ok)
        goto out;
    *base = b;
    b = NULL;
    miss = 0;
out:
    Py_XDECREF(b);
    Py_XDECREF(scaling);
    Py_XDECREF(modules);
    Py_XDECREF(d);
    return miss != 0 && PyErr_Occurred() ? plan_miss() : miss;
}

/* plan_run(plan, x) -> the output, None, or (result, base): see the top of this file */
static PyObject *edge_plan_run(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *plan, *x;
    if (!PyArg_UnpackTuple(args, "plan_run", 2, 2, &plan, &x))
        return NULL;
    if (!PyTuple_Check(plan) || PyTuple_Size(plan) != PLAN_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "lora._edge: plan_run(plan tuple, x)");
        return NULL;
    }
    const int64_t nd = PyLong_AsLongLong(PyTuple_GetItem(plan, PLAN_NDIM));
    const int64_t rows = PyLong_AsLongLong(PyTuple_GetItem(plan, PLAN_ROWS));
    const int64_t cols = PyLong_AsLongLong(PyTuple_GetItem(plan, PLAN_COLS));
    const lora_delta *delta = PyLong_AsVoidPtr(PyTuple_GetItem(plan, PLAN_DELTA));
    const double scale = PyFloat_AsDouble(PyTuple_GetItem(plan, PLAN_SCALE));
    PyObject *tab = PyTuple_GetItem(plan, PLAN_TABLE), *ids = PyTuple_GetItem(plan, PLAN_IDS);
    PyObject *sc = PyTuple_GetItem(plan, PLAN_SCALES);
    if (PyErr_Occurred())
        return NULL;
    if (!PyTuple_Check(tab) || PyTuple_Size(tab) < 3 || !PyTuple_Check(sc) || PyTuple_Size(sc) < 1) {
        PyErr_SetString(PyExc_TypeError, "lora._edge: plan_run: a table and scales view");
        return NULL;
    }
    const int64_t n_kernel = PyLong_AsLongLong(PyTuple_GetItem(tab, 0));
    const int64_t *first = PyLong_AsVoidPtr(PyTuple_GetItem(tab, 1));
    const lora_delta *const *deltas = PyLong_AsVoidPtr(PyTuple_GetItem(tab, 2));
    const double *scales = PyLong_AsVoidPtr(PyTuple_GetItem(sc, 0));
    if (PyErr_Occurred())
        return NULL;
    if ((delta == NULL && (first == NULL || deltas == NULL || scales == NULL || n_kernel < 1))
        || (delta != NULL && ids != Py_None) || rows < 2 || cols < 2 || nd < 2) {
        PyErr_SetString(PyExc_ValueError, "lora._edge: plan_run: a plan without its deltas");
        return NULL;
    }
    /* x: a plain contiguous CPU tensor of the plan's axes, else the Python plan takes it */
    if (E.tensor == NULL || Py_TYPE(x) != E.tensor)
        Py_RETURN_NONE;
    facts fx, fo;
    fx.keep = fo.keep = NULL;
    int st = tensor_facts(x, 0, &fx);
    const int64_t *idp = NULL;
    if (st == 0 && fx.nd != nd)
        st = EDGE_DECLINE;
    /* a mixed batch: one id per leading row (PEFT's length check is the Python path's) */
    if (st == 0 && ids != Py_None && (idp = vector_of(ids, E.int64, fx.dim[0])) == NULL)
        st = EDGE_DECLINE;
    PyObject *base = NULL;
    if (st == 0)
        st = plan_check(plan, &base);
    if (st != 0) {
        Py_XDECREF(fx.keep);
        if (st == -2)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *result = PyObject_CallFunctionObjArgs(base, x, NULL);
    if (result == NULL) {
        Py_DECREF(base);
        Py_XDECREF(fx.keep);
        return NULL;
    }
    /* the tail: a fresh plain tensor out of the stack's shape, no hooks on the base layer that
     * might keep it; else the Python tail */
    int miss = EDGE_DECLINE;
    st = EDGE_DECLINE;
    if (Py_TYPE(result) != E.tensor || attr_true(base, PN.fwd_hooks, &miss) != 0)
        goto tail;
    if ((st = tensor_facts(result, 1, &fo)) != 0)
        goto tail;
    st = EDGE_DECLINE;
    int64_t n = 1;
    if (fo.nd != nd || fx.dim[nd - 1] != cols || fo.dim[nd - 1] != rows)
        goto tail;
    for (int64_t i = 0; i < nd - 1; i++) {
        if (fx.dim[i] != fo.dim[i])
            goto tail;
        n *= fo.dim[i];
    }
    st = 0;
    int64_t bad = -1;
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        static const int64_t one[2] = {0, 1};
        const double s = (float)scale;
        st = delta != NULL
                 ? project(1, one, &delta, &s, NULL, NULL, 1, rows, cols, n, fx.ptr, fx.code, cols,
                           fo.ptr, fo.code, rows, NULL)
                 : project(n_kernel, first, deltas, scales, idp, NULL,
                           idp != NULL ? n / fx.dim[0] : 1, rows, cols, n, fx.ptr, fx.code, cols,
                           fo.ptr, fo.code, rows, &bad);
        Py_END_ALLOW_THREADS
    }
tail:
    Py_XDECREF(fx.keep);
    Py_XDECREF(fo.keep);
    if (st == -2 || (st != 0 && PyErr_Occurred() && miss == -2)) {
        Py_DECREF(base);
        Py_DECREF(result);
        return NULL;
    }
    PyErr_Clear(); /* a read that raised: the Python tail meets it again */
    if (st == 0) {
        Py_DECREF(base);
        return result;
    }
    PyObject *pair = PyTuple_Pack(2, result, base);
    Py_DECREF(base);
    Py_DECREF(result);
    return pair;
}
