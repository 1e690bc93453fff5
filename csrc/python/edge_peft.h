/*
 * csrc/python/edge_peft.h - lora._edge's plan_run: the short path of a PEFT LoRA Linear layer
 * under accelerate_peft (lora.peft_accel's Plan), in C: the one copy of the checks that PEFT's
 * state has not moved since the plan was made.
 *
 * At batch-1 decode a layer's call is mostly the checks that PEFT's state has not moved since
 * the plan was made (active adapters, merge and disable flags, hooks, the adapter modules and
 * their parameters, the scaling) and then one kernel call.  Between two layers the base model
 * streams megabytes of weights through the caches, so these checks run with cold caches; in
 * Python each attribute read is a chain of dependent lookups through the interpreter.  Here the
 * same reads are a few C calls each, with the rules of the Python layer's full path.
 *
 * A plan serves either the layer's active adapters (summed in order, one stack) or one mixed
 * batch of PEFT's adapter_names (row b on its own adapter, through the entry table's ids: the
 * call the Python mixed path makes).  DoRA adapters are members with a row-factor epilogue; what
 * their statistics were made from is the plan's `watch`, a Python callable (DoRA's room) that
 * answers whether it still holds.
 *
 * plan_run(plan, x) answers
 *   the layer's output    the base layer ran and the LoRA term was added in place;
 *   None                  declined before the base layer ran: the Python layer takes the call
 *                         from its start (its checks then find what moved, or an x this path
 *                         does not take);
 *   (result, base)        the base layer ran (once: hooks may count calls), but its result is
 *                         not the fast case, or C refused the call: the Python plan's tail
 *                         takes it from there and raises the precise error.
 * The plan tuple is built by the Python Plan (PLAN_* below are its fields) and holds what keeps
 * the C call's memory alive.  Included by edge.c (one extension, one state E).
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
    PLAN_HOOKS,        /* torch.nn.modules.module: where torch keeps global module hooks */
    PLAN_VIEW,         /* the entry table's view (see read_view in edge.c) */
    PLAN_SCALES,       /* the table's scales as (address, epilogue data address, ...) */
    PLAN_IDS,          /* a mixed batch: int64 ndarray [x.shape[0]], row b's entry (-1: none);
                          else None */
    PLAN_ABSENT,       /* a mixed batch's adapter names this layer does not hold (still absent) */
    PLAN_KEEP,         /* the entry table: it owns the deltas behind the addresses */
    PLAN_TYPES,        /* tuple of (type(lora_A[a]), type(lora_B[a]), type(lora_dropout[a])) */
    PLAN_WATCH,        /* None, or a callable: True while the DoRA statistics still hold */
    PLAN_FIELDS
};

static struct {
    PyObject *dict, *active, *disable, *merged, *training, *modules, *base_layer, *lora_a,
        *lora_b, *dropout, *fwd_hooks, *fwd_pre_hooks, *parameters, *weight, *p,
        *scaling, *g_fwd_hooks, *g_fwd_pre_hooks, *forward, *bias, *requires_grad;
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
        {&PN.bias, "bias"}, {&PN.requires_grad, "requires_grad"},
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
    return PyErr_Occurred() ? miss() : EDGE_DECLINE;
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

/* in grad mode: a base layer without submodules none of whose own parameters requires grad */
static int base_grad_free(PyObject *base, int *miss)
{
    PyObject *mods = PyObject_GetAttr(base, PN.modules);
    PyObject *params = mods != NULL ? PyObject_GetAttr(base, PN.parameters) : NULL;
    int ok = mods != NULL && PyDict_Check(mods) && PyDict_Size(mods) == 0 && params != NULL
             && PyDict_Check(params);
    Py_ssize_t pos = 0;
    PyObject *key, *val;
    while (ok && PyDict_Next(params, &pos, &key, &val))
        ok = val == Py_None || attr_true(val, PN.requires_grad, miss) == 0;
    Py_XDECREF(mods);
    Py_XDECREF(params);
    if (PyErr_Occurred())
        *miss = plan_miss();
    return ok;
}

/* the checks of a plan before its base call: 0 with *base (a new reference),
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
    /* autograd records when grad mode is on and x, a LoRA weight or a base weight requires
     * grad: then PEFT's own forward (x is checked by plan_run, the base layer's own
     * parameters here, the adapters' below; a base layer with submodules is left to the
     * Python layer in grad mode) */
    int grad = is_true(PyObject_CallObject(E.grad_enabled, NULL));
    if (grad < 0)
        goto out;
    if (grad && !base_grad_free(b, &miss))
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
                 && same_tensor(p, kq, i, PyTuple_GetItem(cq, i), &miss)
                 && (!grad || attr_true(p, PN.requires_grad, &miss) == 0);
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

/* What plan_run and plan_holds share before the base call: the plan's view into *v, x's facts
 * (fx) and the mixed batch's ids (fi: their keep is the caller's to release), the checks of
 * plan_check, and DoRA's watch.  0 with *base (a new reference), EDGE_DECLINE, or -2 (a Python
 * error: NULL from the entry). */
static int plan_before_base(PyObject *plan, PyObject *x, table_view *v, double *one, facts *fx,
                            facts *fi, PyObject **base)
{
    *base = NULL;
    fx->keep = fi->keep = NULL;
    if (!PyTuple_Check(plan) || PyTuple_Size(plan) != PLAN_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "lora._edge: plan_run(plan tuple, x)");
        return EDGE_ERROR;
    }
    const int64_t nd = PyLong_AsLongLong(PyTuple_GetItem(plan, PLAN_NDIM));
    PyObject *ids = PyTuple_GetItem(plan, PLAN_IDS), *watch = PyTuple_GetItem(plan, PLAN_WATCH);
    if (PyErr_Occurred()
        || read_view(PyTuple_GetItem(plan, PLAN_VIEW), PyTuple_GetItem(plan, PLAN_SCALES), v,
                     one) < 0)
        return EDGE_ERROR;
    lora_call *c = &v->c;
    if (c->rows < 2 || c->cols < 2 || nd < 2 || (c->epilogues != NULL && v->epi_op != OP_BATCH)) {
        PyErr_SetString(PyExc_ValueError, "lora._edge: plan_run: a plan without its deltas");
        return EDGE_ERROR;
    }
    /* x: a plain CPU tensor of the plan's axes, its rows readable in place, that does not
     * require grad (plan_check reads grad mode); else the Python layer takes it */
    if (E.tensor == NULL || Py_TYPE(x) != E.tensor)
        return EDGE_DECLINE;
    int st = tensor_facts(x, 0, -1, fx), m = EDGE_DECLINE;
    int64_t nx = 0;
    if (st == 0 && (fx->nd != nd || rows_of(fx, c->cols, &nx, &c->ldx) != 0
                    || attr_true(x, PN.requires_grad, &m) != 0))
        st = m == EDGE_ERROR ? EDGE_ERROR : EDGE_DECLINE;
    /* a mixed batch: one id per leading row (PEFT's length check is the Python path's) */
    if (st == 0 && ids != Py_None) {
        if (facts_of(ids, 0, KIND_I64, fi) != 0 || fi->nd != 1 || fi->dim[0] != fx->dim[0])
            st = EDGE_DECLINE;
        else
            c->entry_ids = fi->ptr;
    }
    if (st == 0)
        st = plan_check(plan, base);
    if (st == 0 && watch != Py_None) { /* the DoRA statistics: DoRA's own rule, in Python */
        const int held = is_true(PyObject_CallObject(watch, NULL));
        st = held == 1 ? 0 : held == 0 ? EDGE_DECLINE : miss();
    }
    if (st != 0)
        Py_CLEAR(*base);
    return st;
}

/* plan_holds(plan, x) -> the base layer when the plan serves a call on x now (its checks, made
 * without calling the base layer: a compiled graph computes the base output itself), else
 * None */
static PyObject *edge_plan_holds(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *plan, *x, *base = NULL;
    if (!PyArg_UnpackTuple(args, "plan_holds", 2, 2, &plan, &x))
        return NULL;
    table_view v;
    double one;
    facts fx, fi;
    const int st = plan_before_base(plan, x, &v, &one, &fx, &fi, &base);
    Py_XDECREF(fx.keep);
    Py_XDECREF(fi.keep);
    if (st == EDGE_ERROR)
        return NULL;
    if (st != 0)
        Py_RETURN_NONE;
    return base;
}

/* plan_run(plan, x) -> the output, None, or (result, base): see the top of this file */
static PyObject *edge_plan_run(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *plan, *x, *base = NULL;
    if (!PyArg_UnpackTuple(args, "plan_run", 2, 2, &plan, &x))
        return NULL;
    table_view v;
    double one;
    facts fx, fo, fi;
    fo.keep = NULL;
    int st = plan_before_base(plan, x, &v, &one, &fx, &fi, &base), m = EDGE_DECLINE;
    lora_call *c = &v.c;
    const int64_t nd = fx.nd;
    if (st != 0) {
        Py_XDECREF(fx.keep);
        Py_XDECREF(fi.keep);
        if (st == EDGE_ERROR)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *result = PyObject_CallFunctionObjArgs(base, x, NULL);
    if (result == NULL) {
        Py_DECREF(base);
        Py_XDECREF(fx.keep);
        Py_XDECREF(fi.keep);
        return NULL;
    }
    /* the tail: a fresh plain tensor out of the stack's shape, no hooks on the base layer that
     * might keep it; else the Python tail */
    st = EDGE_DECLINE;
    if (Py_TYPE(result) != E.tensor || attr_true(base, PN.fwd_hooks, &m) != 0)
        goto tail;
    if ((st = tensor_facts(result, 1, -1, &fo)) != 0)
        goto tail;
    st = EDGE_DECLINE;
    if (fo.nd != nd || !same_dims(fx.dim, fo.dim, nd - 1) || rows_of(&fo, c->rows, &c->n, &c->ldo) != 0)
        goto tail;
    c->op = LORA_OP_PROJECT;
    c->x = fx.ptr, c->x_dtype = fx.code, c->out = fo.ptr, c->out_dtype = fo.code;
    if (c->entry_ids != NULL)
        c->ids_every = fx.dim[0] ? c->n / fx.dim[0] : 1;
    int64_t bad = -1;
    c->bad = &bad;
    st = 0;
    if (c->n > 0) {
        if (note_write(result) < 0) {
            st = EDGE_ERROR;
            goto tail;
        }
        Py_BEGIN_ALLOW_THREADS
        st = E.apply(c);
        Py_END_ALLOW_THREADS
    }
tail:
    Py_XDECREF(fx.keep);
    Py_XDECREF(fo.keep);
    Py_XDECREF(fi.keep);
    if (st == EDGE_ERROR || (st != 0 && PyErr_Occurred() && m == EDGE_ERROR)) {
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
