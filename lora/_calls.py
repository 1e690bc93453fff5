"""Temporary: the old positional C calls over lora_apply (one lora_call per call)."""

from ._lora_cffi import ffi, lib

NULL = ffi.NULL
_FIRST1 = ffi.new("int64_t[2]", [0, 1])
_EPI = {}


def _epi(n):
    got = _EPI.get(n)
    if got is None:
        got = _EPI[n] = ffi.new("uint8_t[]", [lib.LORA_EPI_ROW_FACTOR] * max(n, 1))
    return got


def _cast(p):
    return ffi.cast("void *", p) if isinstance(p, int) else p


def _run(op, n_entries, first, deltas, scales, idp, posp, every, rows, cols, n, xp, xc, ldx,
         op_, oc, ldo, bad, ids=NULL, factors=NULL, stride=0, **extra):
    c = ffi.new("lora_call *")
    c.op = op
    c.n_entries, c.first, c.deltas, c.scales = n_entries, first, deltas, scales
    if factors != NULL:
        c.epilogues = _epi(first[n_entries])
        c.epi_data, c.epi_stride = factors, stride
    c.rows, c.cols, c.n = rows, cols, n
    c.entry_ids, c.pos_scales, c.ids_every = idp, posp, every
    c.ids = ids
    for k, v in extra.items():
        setattr(c, k, v)
    c.x, c.x_dtype, c.ldx = _cast(xp), xc, ldx
    c.out, c.out_dtype, c.ldo = _cast(op_), oc, ldo
    c.bad = bad
    return lib.lora_apply(c)


def lora_add(d, s, xp, xc, op, oc):
    return lora_add_batch(d, s, 1, xp, xc, 0, op, oc, 0)


def lora_add_at(d, s, xa, xc, oa, oc):
    return lora_add(d, s, xa, xc, oa, oc)


def lora_add_batch(d, s, n, xp, xc, ldx, op, oc, ldo):
    dp = ffi.new("lora_delta *[1]", [d])
    sc = ffi.new("double[1]", [float(ffi.cast("float", s))])
    rows, cols = _shape(d)
    return _run(lib.LORA_OP_PROJECT, 1, _FIRST1, dp, sc, NULL, NULL, 1, rows, cols, n, xp, xc,
                ldx or cols, op, oc, ldo or rows, NULL)


def lora_add_batch_at(d, s, n, xa, xc, ldx, oa, oc, ldo):
    return lora_add_batch(d, s, n, xa, xc, ldx, oa, oc, ldo)


def _shape(d):
    rows, cols = ffi.new("int64_t *"), ffi.new("int64_t *")
    lib.lora_delta_dims(d, NULL, rows, cols)
    return rows[0], cols[0]


def lora_add_rows(d, s, n, ids, op, oc, ldo, bad):
    dp = ffi.new("lora_delta *[1]", [d])
    sc = ffi.new("double[1]", [float(ffi.cast("float", s))])
    rows, cols = _shape(d)
    return _run(lib.LORA_OP_ROWS, 1, _FIRST1, dp, sc, NULL, NULL, 1, rows, cols, n, NULL, 0, 0,
                op, oc, ldo, bad, ids=ids)


def lora_apply_batch(ne, first, deltas, scales, idp, posp, every, rows, cols, n, xp, xc, ldx, op,
                     oc, ldo, bad):
    return _run(lib.LORA_OP_PROJECT, ne, first, deltas, scales, idp, posp, every, rows, cols, n,
                xp, xc, ldx, op, oc, ldo, bad)


def lora_apply_rows(ne, first, deltas, scales, idp, posp, every, rows, cols, n, ids, op, oc, ldo,
                    bad):
    return _run(lib.LORA_OP_ROWS, ne, first, deltas, scales, idp, posp, every, rows, cols, n, NULL,
                0, 0, op, oc, ldo, bad, ids=ids)


def lora_apply_batch_dora(ne, first, deltas, scales, idp, posp, every, rows, cols, n, xp, xc, ldx,
                          op, oc, ldo, factors, stride, bad):
    return _run(lib.LORA_OP_PROJECT, ne, first, deltas, scales, idp, posp, every, rows, cols, n,
                xp, xc, ldx, op, oc, ldo, bad, factors=factors, stride=stride)


def lora_apply_rows_dora(ne, first, deltas, scales, idp, posp, every, rows, cols, n, ids, op, oc,
                         ldo, factors, stride, bad):
    return _run(lib.LORA_OP_ROWS, ne, first, deltas, scales, idp, posp, every, rows, cols, n, NULL,
                0, 0, op, oc, ldo, bad, ids=ids, factors=factors, stride=stride)


def lora_apply_experts(ne, first, deltas, scales, n_adapters, starts, n_experts, aidp, posp, every,
                       idp, x_every, rows, cols, n, xp, xc, ldx, op, oc, ldo, bad):
    return _run(lib.LORA_OP_EXPERTS, ne, first, deltas, scales, aidp, posp, every, rows, cols, n,
                xp, xc, ldx, op, oc, ldo, bad, n_adapters=n_adapters, starts=starts,
                n_experts=n_experts, expert_ids=idp, x_every=x_every)
