"""The guarantees (docs/guarantees.md): determinism, thread-count invariance, batch invariance, stacks as their
deltas in order, the zero-scale skip, the scale rules, and the ISA choice (LORA_ISA)."""

import math
import subprocess

import numpy as np
import pytest

import lora
from lora import _runtime
from lora._lora_cffi import ffi, lib
from conftest import (ISAS, PYTHON, assert_accurate, assert_same_bits, can_run_two_threads,
                      make_delta, num_threads, rand, ref_batch, ref_rows, subprocess_env,
                      using_isa)

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

TWO = can_run_two_threads()
needs_two_threads = pytest.mark.skipif(not TWO, reason="OpenMP gives this process 1 thread")

# batch sizes for the invariance checks: every size up to 33 (partial 4-position blocks, team
# mode below 2 x threads blocks, block mode above) and a large one
BATCHES = list(range(1, 34)) + [512]


def apply(op, entry, arg, out):
    getattr(entry, op)(arg, out)
    return out


# ------------------------------------------------------------- determinism


@pytest.mark.parametrize("op", ["add_to", "add_batch_to", "add_row_to", "add_rows_to"])
def test_same_inputs_same_bits(op, isa, dtype):
    """Twice the same call, and the same call on a second delta built from the same weights: the
    same bits."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((13, 300)), rng.standard_normal((200, 13))
    d1 = lora.LoraDelta(a, b, alpha=7.0, dtype=dtype)
    d2 = lora.LoraDelta(a, b, alpha=7.0, dtype=dtype)
    arg = {"add_to": rand(rng, 300), "add_batch_to": rand(rng, (37, 300)),
           "add_row_to": 199, "add_rows_to": rng.integers(0, 200, 37)}[op]
    shape = {"add_to": (200,), "add_batch_to": (37, 200), "add_row_to": (300,),
             "add_rows_to": (37, 300)}[op]
    out0 = rand(rng, shape)
    r1 = apply(op, d1, arg, out0.copy())
    r2 = apply(op, d1, arg, out0.copy())
    r3 = apply(op, d2, arg, out0.copy())
    assert_same_bits(r1, r2, "same call twice")
    assert_same_bits(r1, r3, "a twin delta")


# ------------------------------------------------------- threads and batches


@needs_two_threads
def test_decode_thread_invariance(isa, dtype):
    """4096 x 4096 rank 16 decode is above the parallel threshold (the team splits A.x's rank
    outputs and B.y's rows): 1 and 2 threads give the same bits; so does a small decode."""
    rng = np.random.default_rng(2)
    for rows, cols in ((4096, 4096), (4096, 33), (33, 4096), (16, 16)):
        d = make_delta(rng, 16, rows, cols, dtype, alpha=32.0)
        x, out0 = rand(rng, cols), rand(rng, rows)
        with num_threads(1):
            assert lib.lora_probe_threads() == 1
            r1 = apply("add_to", d, x, out0.copy())
        with num_threads(2):
            assert lib.lora_probe_threads() == 2
            r2 = apply("add_to", d, x, out0.copy())
        assert_same_bits(r1, r2, f"decode [{rows} x {cols}], 1 vs 2 threads")


@needs_two_threads
def test_invariance_across_column_blocks(isa, dtype):
    """Rows past LORA_JBLOCK (4096) columns, whose lanes sum in blocks: decode and every batch
    row give the same bits, on 1 thread and on a team of 2 forced for every call (the floor at
    1, the back-off reset), with the row ending on, just past and inside a block edge (a tail
    of 1-15 columns, a whole vector after the edge), for float32 and bfloat16 x."""
    jblock = lib.lora_project_column_block()
    calls = ffi.new("int64_t *"), ffi.new("int64_t *")
    rng = np.random.default_rng(9)
    for cols in (jblock, jblock + 1, jblock + 15, jblock + 16, jblock + 33, 2 * jblock,
                 2 * jblock + 40, 3 * jblock - 8):
        d = make_delta(rng, 16, 40, cols, dtype, alpha=16.0)
        for xt in ("float32", "bfloat16"):
            x_all = rand(rng, (9, cols))
            if xt == "bfloat16":
                import ml_dtypes
                x_all = x_all.astype(ml_dtypes.bfloat16)
            out0 = rand(rng, (9, 40))
            with num_threads(1):
                singles = [apply("add_to", d, x_all[b], out0[b].copy()) for b in range(9)]
            for threads in (1, 2):
                with num_threads(threads):
                    for n in (1, 2, 3, 4, 5, 9):
                        # two threads must really run: no back-off, a team for every call
                        lib.lora_team_reset()
                        lib.lora_team_set_min_work(1 if threads == 2 else 0)
                        try:
                            got = apply("add_batch_to", d, x_all[:n], out0[:n].copy())
                            lib.lora_team_stats(*calls)
                        finally:
                            lib.lora_team_set_min_work(0)
                            lib.lora_team_reset()
                        if threads == 2:
                            assert calls[0][0] >= 1, f"cols {cols} batch {n}: no team call"
                        for b in range(n):
                            assert_same_bits(singles[b], got[b],
                                             f"cols {cols} x {xt} batch {n} row {b}, {threads} threads")


def _batch_invariance(d, rng, rows, cols, threads):
    """For every batch size: row b of add_batch_to == add_to(x[b]); return the batched results."""
    x_all = rand(rng, (max(BATCHES), cols))
    out_all = rand(rng, (max(BATCHES), rows))
    with num_threads(threads):
        singles = [apply("add_to", d, x_all[b], out_all[b].copy()) for b in range(max(BATCHES))]
        results = {}
        for n in BATCHES:
            got = apply("add_batch_to", d, x_all[:n], out_all[:n].copy())
            for b in range(n):
                assert_same_bits(got[b], singles[b], f"batch {n} row {b} vs add_to, "
                                 f"{threads} thread(s)")
            results[n] = got
    return results


def test_batch_invariance_one_thread(isa, dtype):
    rng = np.random.default_rng(3)
    d = make_delta(rng, 16, 1024, 1024, dtype, alpha=16.0)
    _batch_invariance(d, rng, 1024, 1024, 1)


@needs_two_threads
def test_batch_and_thread_invariance(isa, dtype):
    """A 1024 x 1024 rank-16 delta: batch 1 runs serially, 2..7 with the whole team on each block,
    8 and up with threads taking whole blocks.  Every row equals add_to(x[b]) at 2 threads, and
    the batched results equal the 1-thread ones."""
    rng = np.random.default_rng(4)
    d = make_delta(rng, 16, 1024, 1024, dtype, alpha=16.0)
    r2 = _batch_invariance(d, np.random.default_rng(5), 1024, 1024, 2)
    r1 = _batch_invariance(d, np.random.default_rng(5), 1024, 1024, 1)
    for n in BATCHES:
        assert_same_bits(r1[n], r2[n], f"batch {n}: 1 vs 2 threads")


@needs_two_threads
def test_gather_batch_and_thread_invariance(isa, dtype):
    """add_rows_to row i == add_row_to(ids[i]) for every batch size, 1 and 2 threads.  A row of
    4096 columns at rank 16 is 2^16 multiply-adds: the sizes straddle the row count at which a
    call reaches the team floor (``lib.lora_team_min_work()``; a team splits the columns), and
    reach the sizes where threads take whole blocks."""
    rng = np.random.default_rng(6)
    d = make_delta(rng, 16, 300, 4096, dtype, alpha=16.0)
    team_rows = -(-lib.lora_team_min_work() // (16 * 4096))
    sizes = sorted({1, 2, 3, 5, 8, 9, 17, 33, 512} | {n for n in (team_rows - 1, team_rows,
                                                              team_rows + 1) if 0 < n <= 512})
    ids = rng.integers(0, 300, size=max(BATCHES))
    out_all = rand(rng, (max(BATCHES), 4096))
    per_threads = {}
    for threads in (1, 2):
        with num_threads(threads):
            singles = [apply("add_row_to", d, int(ids[i]), out_all[i].copy())
                       for i in range(len(ids))]
            res = {}
            for n in sizes:
                got = apply("add_rows_to", d, ids[:n], out_all[:n].copy())
                for i in range(n):
                    assert_same_bits(got[i], singles[i], f"rows {n} row {i}, {threads} threads")
                res[n] = got
            per_threads[threads] = res
    for n, got in per_threads[1].items():
        assert_same_bits(got, per_threads[2][n], f"rows {n}: 1 vs 2 threads")


@pytest.mark.parametrize("rank", [1, 5, 16, 33, 127])
def test_batch_invariance_across_ranks(rank, isa, dtype):
    """Small shapes that straddle the kernels' tiles (4 ranks, 2-4 positions, 8/16/64 rows):
    batch rows equal single calls at every batch size up to 9."""
    rng = np.random.default_rng(rank)
    for rows, cols in ((17, 33), (1, 7), (65, 1), (31, 16)):
        d = make_delta(rng, rank, rows, cols, dtype)
        x, out0 = rand(rng, (9, cols)), rand(rng, (9, rows))
        singles = [apply("add_to", d, x[b], out0[b].copy()) for b in range(9)]
        ids = rng.integers(0, rows, 9)
        rsingles = [apply("add_row_to", d, int(ids[i]), rand(np.random.default_rng(i), cols))
                    for i in range(9)]
        for n in range(1, 10):
            got = apply("add_batch_to", d, x[:n], out0[:n].copy())
            for b in range(n):
                assert_same_bits(got[b], singles[b], f"[{rows} x {cols}] batch {n} row {b}")
            rout = np.stack([rand(np.random.default_rng(i), cols) for i in range(n)])
            got = apply("add_rows_to", d, ids[:n], rout)
            for i in range(n):
                assert_same_bits(got[i], rsingles[i], f"[{rows} x {cols}] rows {n} row {i}")


# ------------------------------------------------------------------ stacks


@pytest.mark.parametrize("threads", [1, 2])
def test_stack_equals_its_deltas_in_order(threads, isa, dtype):
    """A stack (mixed ranks, dtypes, scales; one delta twice) is bit-identical to applying its
    deltas one after another, for every op, at sizes below and above the parallel threshold."""
    if threads == 2 and not TWO:
        pytest.skip("one thread only")
    rng = np.random.default_rng(7)
    for rows, cols, n in ((40, 24, 7), (1024, 1024, 1), (1024, 1024, 37)):
        ds = [make_delta(rng, 8, rows, cols, dtype, alpha=16.0),
              make_delta(rng, 3, rows, cols, "float32", scale=-0.5),
              make_delta(rng, 16, rows, cols, "bfloat16", alpha=4.0, rslora=True)]
        ds.append(ds[0])
        stack = lora.LoraStack(ds)
        x, ids = rand(rng, (n, cols)), rng.integers(0, rows, n)
        with num_threads(threads):
            for op, arg, shape in (("add_to", x[0], (rows,)), ("add_batch_to", x, (n, rows)),
                                   ("add_row_to", int(ids[0]), (cols,)),
                                   ("add_rows_to", ids, (n, cols))):
                out0 = rand(rng, shape)
                got = apply(op, stack, arg, out0.copy())
                expect = out0.copy()
                for d in ds:
                    apply(op, d, arg, expect)
                assert_same_bits(got, expect, f"stack.{op} [{rows} x {cols}] n={n}")
                # and batch-invariant like a delta
                if op == "add_batch_to":
                    for b in range(n):
                        one = apply("add_to", stack, x[b], out0[b].copy())
                        assert_same_bits(got[b], one, f"stack batch row {b}")


# ------------------------------------------------------------------ scale 0


def _nasty_x(rng, shape):
    x = rand(rng, shape)
    flat = x.reshape(-1)
    flat[:: 3] = np.inf
    flat[1:: 3] = np.nan
    flat[0] = -np.inf
    return x


@pytest.mark.parametrize("how", ["scale0", "negzero", "underflow", "shared-set0"])
def test_zero_scale_leaves_out_bit_identical(how, isa, dtype):
    """An effective scale of exactly 0 skips every op before any arithmetic: out keeps its bits
    even when x holds inf and nan (0 * inf would be nan)."""
    rng = np.random.default_rng(8)
    for rows, cols, n in ((24, 40, 5), (4096, 4096, 1), (1024, 1024, 40)):
        if how == "scale0":
            d = make_delta(rng, 8, rows, cols, dtype, alpha=16.0, scale=0.0)
        elif how == "negzero":
            d = make_delta(rng, 8, rows, cols, dtype, scale=-0.0)
        elif how == "underflow":  # alpha and scale whose product is exactly 0.0
            d = make_delta(rng, 8, rows, cols, dtype, alpha=1e-200, scale=1e-200)
        else:
            s = lora.LoraScale(2.0)
            d = make_delta(rng, 8, rows, cols, dtype, alpha=16.0, scale=s)
            s.set(0)
        assert d.effective_scale == 0.0
        x = _nasty_x(rng, (n, cols))
        # B and A weights stay finite, but make ids point everywhere
        ids = rng.integers(0, rows, n)
        for threads in (1, 2):
            with num_threads(threads):
                for op, arg, shape in (("add_to", x[0], (rows,)), ("add_batch_to", x, (n, rows)),
                                       ("add_row_to", int(ids[0]), (cols,)),
                                       ("add_rows_to", ids, (n, cols))):
                    out = rand(rng, shape)
                    out.reshape(-1)[-1] = np.nan  # a nan already in out stays the same nan
                    before = out.tobytes()
                    assert getattr(d, op)(arg, out) is out
                    assert out.tobytes() == before, f"{op} at scale 0 ({how}) changed out"
        bank = lora.LoraBank([d, lora.LoraStack([d, d])])
        out = rand(rng, (n, rows))
        before = out.tobytes()
        bank.add_batch_to(x, out, rng.integers(-1, 2, n))
        assert out.tobytes() == before
        out = rand(rng, (n, cols))
        before = out.tobytes()
        bank.add_rows_to(ids, out, rng.integers(-1, 2, n))
        assert out.tobytes() == before


def test_zero_scale_stack_member_is_skipped(isa, dtype):
    """A zero-scale member leaves the stack's result bit-identical to the stack without it."""
    rng = np.random.default_rng(9)
    rows, cols, n = 48, 40, 6
    d1 = make_delta(rng, 8, rows, cols, dtype, alpha=16.0)
    d2 = make_delta(rng, 5, rows, cols, dtype)
    z = make_delta(rng, 4, rows, cols, dtype, scale=0.0)
    with_z, without = lora.LoraStack([d1, z, d2, z]), lora.LoraStack([d1, d2])
    x, ids = rand(rng, (n, cols)), rng.integers(0, rows, n)
    for op, arg, shape in (("add_to", x[0], (rows,)), ("add_batch_to", x, (n, rows)),
                           ("add_row_to", int(ids[0]), (cols,)), ("add_rows_to", ids, (n, cols))):
        out0 = rand(rng, shape)
        assert_same_bits(apply(op, with_z, arg, out0.copy()), apply(op, without, arg, out0.copy()),
                         f"stack.{op} with a zero-scale member")
    # a zero-scale member does not turn inf in x into nan through 0 * inf either: every member 0
    allz = lora.LoraStack([z, z])
    out = rand(rng, (n, rows))
    before = out.tobytes()
    allz.add_batch_to(_nasty_x(rng, (n, cols)), out)
    assert out.tobytes() == before


def test_merge_at_scale_zero_keeps_w(dtype):
    rng = np.random.default_rng(10)
    d = make_delta(rng, 8, 30, 20, dtype, alpha=16.0, scale=0.0)
    w = rand(rng, (30, 20))
    w.reshape(-1)[3] = np.nan
    before = w.tobytes()
    assert d.merge_into(w) is w and w.tobytes() == before
    assert d.unmerge_from(w) is w and w.tobytes() == before
    wt = np.ascontiguousarray(w.T)
    before = wt.tobytes()
    d.merge_into(wt.T)
    assert wt.tobytes() == before
    lora.LoraStack([d, d]).merge_into(w)
    assert w.tobytes() == np.ascontiguousarray(wt.T).tobytes()


# -------------------------------------------------------------- scale rules


def test_scale_rules(isa):
    """effective_scale = scale * alpha_factor: alpha/rank (llama.cpp get_scale, PEFT),
    alpha/sqrt(rank) with rslora (PEFT use_rslora), 1 when alpha == 0; negatives allowed; the
    kernels apply exactly that scale."""
    rng = np.random.default_rng(11)
    rank, rows, cols = 9, 20, 30
    a, b = rng.standard_normal((rank, cols)), rng.standard_normal((rows, rank))
    cases = [
        (dict(alpha=18.0), 18.0 / 9),
        (dict(alpha=18.0, rslora=True), 18.0 / 3),
        (dict(alpha=0.0), 1.0),
        (dict(alpha=0.0, rslora=True), 1.0),
        (dict(alpha=-4.5), -0.5),
        (dict(alpha=18.0, scale=-2.0), -4.0),
        (dict(alpha=-18.0, scale=-0.25, rslora=True), 1.5),
        (dict(alpha=0.0, scale=0.3), 0.3),
        (dict(alpha=7.0), 7.0 / 9),
    ]
    x = rand(rng, (4, cols))
    for kw, want in cases:
        d = lora.LoraDelta(a, b, **kw)
        assert math.isclose(d.effective_scale, want, rel_tol=1e-15), (kw, d.effective_scale)
        assert d.alpha == kw["alpha"]
        out0 = rand(rng, (4, rows))
        out = d.add_batch_to(x, out0.copy())
        ref, np32 = ref_batch([d], x, out0)
        assert_accurate(out, ref, np32, f"scale rule {kw}")
        # the same delta without alpha and with the scale folded in gives the same bits
        plain = lora.LoraDelta(a, b, scale=d.effective_scale)
        assert_same_bits(out, plain.add_batch_to(x, out0.copy()), f"{kw} folded")
        # negating the scale negates the delta exactly (out = 0 isolates the delta)
        neg = lora.LoraDelta(a, b, scale=-d.effective_scale)
        z1, z2 = np.zeros((4, rows), np.float32), np.zeros((4, rows), np.float32)
        d.add_batch_to(x, z1)
        neg.add_batch_to(x, z2)
        assert_same_bits(z1, -z2, f"{kw} negated")


# -------------------------------------------------------------------- ISA


def test_kernel_info_shape():
    info = lora.kernel_info()
    assert set(info) >= {"isa", "isa_reason", "cpu", "available_isas", "openmp", "threads",
                         "compiler", "version"}
    assert info["isa"] in ("scalar", "avx2", "avx512", "neon")
    assert info["isa"] in info["available_isas"] and "scalar" in info["available_isas"]
    assert info["threads"] == lora.get_num_threads()
    assert isinstance(info["openmp"], bool) and isinstance(info["compiler"], str)
    assert info["version"] == lora.__version__
    assert isinstance(info["isa_reason"], str)
    assert info["isa_reason"].startswith(("table: ", "flags: ", "LORA_ISA=", "set_isa("))
    cpu = info["cpu"]
    assert list(cpu) == ["vendor", "family", "model", "stepping", "name"]
    if "avx2" in info["available_isas"]:  # x86: cpuid was read
        assert isinstance(cpu["vendor"], str) and len(cpu["vendor"]) == 12
        assert all(type(cpu[k]) is int and cpu[k] >= 0 for k in ("family", "model", "stepping"))
    if cpu["vendor"] is None:
        assert cpu["family"] is cpu["model"] is cpu["stepping"] is cpu["name"] is None
    assert cpu["name"] is None or isinstance(cpu["name"], str) and cpu["name"]


def _row(vendor, family, model, flags):
    """lora_isa_for_cpu for a made-up CPU id: (path name, table name, evidence)."""
    name, evidence = _runtime.ffi.new("const char *[1]"), _runtime.ffi.new("const char *[1]")
    got = lib.lora_isa_for_cpu(_runtime.ffi.NULL if vendor is None else vendor.encode(), family, model,
                               _runtime.ISA_CODES[flags], name, evidence)

    def text(p):
        return None if p == _runtime.ffi.NULL else _runtime.ffi.string(p).decode()

    return _runtime.ISA_NAMES[got], text(name[0]), text(evidence[0])


def test_cpu_table_rows_name_measured_cores_and_keep_the_flags_rule():
    """The measured cores are named; none overrides the flags rule (each measured fastest on the
    widest path its flags allow).  A row's evidence points at its measurement."""
    for flags in ("scalar", "avx2", "avx512"):
        isa, name, evidence = _row("GenuineIntel", 6, 106, flags)
        assert (isa, name) == (flags, "Ice Lake-SP") and "docs/performance.md" in evidence
        isa, name, evidence = _row("AuthenticAMD", 25, 1, flags)
        assert (isa, name) == (flags, "Zen 3 (Milan)") and "--isa-compare" in evidence
        isa, name, evidence = _row("AuthenticAMD", 25, 0x11, flags)
        assert (isa, name) == (flags, "Zen 4 (Genoa)") and "--isa-compare" in evidence


@pytest.mark.parametrize("cpu_id", [
    ("AuthenticAMD", 25, 0x61),   # Zen 4 (Raphael): only Genoa (0x11) was measured
    ("AuthenticAMD", 25, 0x10),   # the Zen 4 models either side of the measured one
    ("AuthenticAMD", 25, 0x12),
    ("GenuineIntel", 6, 143),     # Sapphire Rapids: no machine line recorded
    ("GenuineIntel", 25, 1),      # Zen 3's family and model under another vendor
    ("AuthenticAMD", 6, 106),     # Ice Lake's under another vendor
    ("HygonGenuine", 24, 0),
    ("", -1, -1),                 # what lora_cpu_id gives where there is no cpuid (aarch64)
    (None, 25, 1),
])
def test_cpu_without_a_table_row_runs_the_flags_rule(cpu_id):
    for flags in ("scalar", "avx2", "avx512", "neon"):
        assert _row(*cpu_id, flags) == (flags, None, None)


def test_lora_isa_env_and_the_load_time_choice_follow_the_table_lookup():
    """A fresh process runs what lora_isa_for_cpu gives this CPU's cpuid id and flags rule, and
    says why; LORA_ISA forces another supported path and says so."""
    code = ("import lora; from lora import _runtime as r\n"
            "i = lora.kernel_info(); print(i['isa']); print(r._cpu_row()[1]); print(i['isa_reason'])\n")
    p = subprocess.run([PYTHON, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    isa, looked_up, reason = p.stdout.splitlines()
    assert isa == looked_up
    cpu = lora.kernel_info()["cpu"]
    flags = _runtime.ISA_NAMES[lib.lora_best_isa()]
    assert _row(cpu["vendor"] or "", cpu["family"] or -1, cpu["model"] or -1, flags)[0] == isa
    assert reason.startswith("table: " if isa != flags else "flags: ")
    if cpu["name"]:
        assert cpu["name"] in reason
    p = subprocess.run([PYTHON, "-c", code], env=subprocess_env(LORA_ISA="scalar"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    isa, looked_up, reason = p.stdout.splitlines()
    assert (isa, looked_up) == ("scalar", _row(cpu["vendor"] or "", cpu["family"] or -1,
                                               cpu["model"] or -1, flags)[0])
    assert reason.startswith("LORA_ISA=scalar (the default here: ")


def test_set_isa_is_named_as_the_reason():
    with using_isa("scalar"):
        assert lora.kernel_info()["isa_reason"].startswith("set_isa('scalar') (the default here: ")


def _isa_in_child(value):
    code = ("import lora\n"
            "info = lora.kernel_info()\n"
            "print(info['isa'])\n"
            "print(','.join(info['available_isas']))\n"
            "print(info['isa_reason'].split(':')[0])\n")
    env = subprocess_env() if value is None else subprocess_env(LORA_ISA=value)
    p = subprocess.run([PYTHON, "-W", "always", "-c", code], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    isa, avail, source = p.stdout.splitlines()
    return isa, avail.split(","), p.stderr, source


def test_lora_isa_env_forces_any_supported_path():
    best, avail, err, source = _isa_in_child(None)
    # the default: the widest path, unless the CPU table names a narrower one for this model
    assert (best == avail[-1]) == (source == "flags") and "Warning" not in err
    for name in avail:
        isa, _, err, source = _isa_in_child(name)
        assert isa == name and "RuntimeWarning" not in err and source == f"LORA_ISA={name} (the default here"
    isa, *_ = _isa_in_child(" Scalar ")
    assert isa == "scalar"


def _widening_of(vendor, family, model):
    return _runtime._Q8_0_WIDENING_NAMES[lib.lora_q8_0_widening_for_cpu(vendor.encode(), family, model)]


def test_q8_0_widening_follows_the_cpu_table():
    """Zen 4 Genoa builds q8_0 values by conversion (measured faster there); every other core,
    with a row or without, by the shuffle measured on Intel's.  Either gives the same bits
    (test_q8_0.py runs every op under both)."""
    assert _widening_of("AuthenticAMD", 25, 0x11) == "cvt"
    for cpu_id in (("GenuineIntel", 6, 106), ("AuthenticAMD", 25, 1), ("AuthenticAMD", 25, 0x61),
                   ("GenuineIntel", 6, 143), ("", -1, -1)):
        assert _widening_of(*cpu_id) == "shuffle"
    cpu = lora.kernel_info()["cpu"]
    want = _runtime._table_q8_0_widening(cpu)  # this CPU's lookup
    p = subprocess.run([PYTHON, "-c", "import lora; print(lora.kernel_info()['q8_0_widening'])"],
                       env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    reason = p.stdout.strip()  # a fresh process: nothing forced it
    assert reason.startswith(f"{want}: ")
    assert (cpu["name"] or "the default without a CPU table row") in reason


def test_q8_0_widening_env_and_setter():
    code = "import lora; print(lora.kernel_info()['q8_0_widening'])"
    for name in ("shuffle", "cvt"):
        p = subprocess.run([PYTHON, "-W", "always", "-c", code],
                           env=subprocess_env(LORA_Q8_0_WIDENING=f" {name.upper()} "),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "Warning" not in p.stderr, p.stderr
        assert p.stdout.startswith(f"{name}: LORA_Q8_0_WIDENING={name} (the default here: ")
    p = subprocess.run([PYTHON, "-W", "always", "-c", code], env=subprocess_env(LORA_Q8_0_WIDENING="fast"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "RuntimeWarning" in p.stderr and "'fast'" in p.stderr
    table = _runtime._table_q8_0_widening(lora.kernel_info()["cpu"])  # the child's: no env var
    assert p.stdout.startswith(f"{table}: ") and "LORA_Q8_0_WIDENING" not in p.stdout
    previous = _runtime.set_q8_0_widening("cvt")
    try:
        assert lora.kernel_info()["q8_0_widening"].startswith("cvt: set_q8_0_widening('cvt')")
        with using_isa("scalar"):
            assert lora.kernel_info()["q8_0_widening"].endswith("unused on the scalar path (it has one build)")
        for bad in ("fast", ["cvt"], 1):
            with pytest.raises(ValueError, match="is not one of"):
                _runtime.set_q8_0_widening(bad)
        assert _runtime.q8_0_widening() == "cvt"
        assert _runtime.set_q8_0_widening(None) == "cvt"  # back to the table, and its reason
        assert _runtime.q8_0_widening() == table
        assert "set_q8_0_widening" not in lora.kernel_info()["q8_0_widening"]
    finally:
        _runtime.set_q8_0_widening(previous)


def test_lora_isa_env_scalar_prints_scalar():
    p = subprocess.run([PYTHON, "-c", "import lora; print(lora.kernel_info()['isa'])"],
                       env=subprocess_env(LORA_ISA="scalar"), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "scalar", (p.stdout, p.stderr)


def test_lora_isa_env_bogus_warns_and_uses_best():
    best, *_ = _isa_in_child(None)
    isa, _, err, _ = _isa_in_child("bogus")
    assert isa == best
    assert "RuntimeWarning" in err and "bogus" in err


@pytest.mark.parametrize("how", ["script", "module", "cli"])
def test_lora_isa_env_warning_points_at_the_users_import(tmp_path, how):
    """The RuntimeWarning names the line of the user's code that imported lora (a script, or a
    module imported by one), never the import machinery or runpy; under `python -m lora` there
    is no such line, and the command prints it as its own warning line."""
    (tmp_path / "mine.py").write_text("import os\nimport lora\n")
    (tmp_path / "main.py").write_text("x = 1\nimport mine\n")
    args = {"script": [str(tmp_path / "mine.py")], "module": [str(tmp_path / "main.py")],
            "cli": ["-m", "lora", "info"]}[how]
    p = subprocess.run([PYTHON, *args], env=subprocess_env(LORA_ISA="bogus"), cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "frozen" not in p.stderr and "runpy" not in p.stderr, p.stderr
    if how == "cli":
        assert len(p.stderr.splitlines()) == 1, p.stderr
        assert p.stderr.startswith("warning: LORA_ISA='bogus' is not a known ISA path"), p.stderr
    else:
        assert p.stderr.startswith(f"{tmp_path / 'mine.py'}:2: RuntimeWarning: LORA_ISA='bogus'"), \
            p.stderr


def test_lora_isa_env_never_raises_the_choice():
    """A path this CPU cannot run (here: every one it lacks, NEON on x86) falls back to the best
    supported path with a RuntimeWarning; it never selects a path above the CPU."""
    best, avail, *_ = _isa_in_child(None)
    missing = [n for n in ("scalar", "avx2", "avx512", "neon") if n not in avail]
    assert missing, "this CPU runs every path"
    for name in missing:
        isa, _, err, _ = _isa_in_child(name)
        assert isa == best and isa in avail, (name, isa)
        assert "RuntimeWarning" in err


def test_set_isa_refuses_unavailable_paths():
    for name in ("neon" if "neon" not in ISAS else "avx512", "bogus"):
        if name in ISAS:
            continue
        before = _runtime.isa()
        with pytest.raises(ValueError):
            _runtime.set_isa(name)
        assert _runtime.isa() == before


@pytest.mark.skipif(len(ISAS) < 2, reason="only the portable path here")
@pytest.mark.parametrize("op", ["add_to", "add_batch_to", "add_row_to", "add_rows_to"])
def test_simd_paths_agree_with_scalar(op, dtype):
    """Different ISA paths give different bits (another summation order) but agree within float32
    tolerance: each meets the accuracy rule and they are within the oracle's slack of each
    other."""
    rng = np.random.default_rng(13)
    for rank, rows, cols in ((16, 1001, 1001), (33, 17, 31), (1, 1, 1), (128, 64, 7)):
        d = make_delta(rng, rank, rows, cols, dtype, alpha=2.0 * rank)
        n = 9
        arg = {"add_to": rand(rng, cols), "add_batch_to": rand(rng, (n, cols)),
               "add_row_to": int(rng.integers(rows)), "add_rows_to": rng.integers(0, rows, n)}[op]
        shape = {"add_to": (rows,), "add_batch_to": (n, rows), "add_row_to": (cols,),
                 "add_rows_to": (n, cols)}[op]
        out0 = rand(rng, shape)
        if op in ("add_to", "add_batch_to"):
            ref, np32 = ref_batch([d], arg, out0)
        else:
            ref, np32 = ref_rows([d], arg, out0)
        results = {}
        for name in ISAS:
            with using_isa(name):
                results[name] = apply(op, d, arg, out0.copy())
        slack = np.linalg.norm((np32 - ref).ravel()) + 1e-9 * np.linalg.norm(ref.ravel())
        for name, got in results.items():
            diff = np.linalg.norm((got.astype(np.float64) - results["scalar"]).ravel())
            assert diff <= 4 * slack + 1e-30, (name, op, rank, rows, cols, diff, slack)
            rel = np.abs(got.astype(np.float64) - results["scalar"]) / (1e-30 + np.abs(ref))
            assert np.all((rel < 1e-3) | (np.abs(got - results["scalar"]) < 1e-4 *
                                           np.abs(ref).max())), (name, op)


@pytest.mark.parametrize("threads", [1, 2])
def test_invariance_above_the_stack_scratch_rank(threads, isa):
    """Rank 600 needs heap scratch (more than 512 floats per position): batch rows still equal
    single calls, for the projection and the gather."""
    if threads == 2 and not TWO:
        pytest.skip("one thread only")
    rng = np.random.default_rng(14)
    d = make_delta(rng, 600, 300, 200, "bfloat16")
    x, out0 = rand(rng, (40, 200)), rand(rng, (40, 300))
    ids, rout0 = rng.integers(0, 300, 40), rand(rng, (40, 200))
    with num_threads(threads):
        got = d.add_batch_to(x, out0.copy())
        rgot = d.add_rows_to(ids, rout0.copy())
        for b in range(40):
            assert_same_bits(got[b], d.add_to(x[b], out0[b].copy()), f"row {b}")
            assert_same_bits(rgot[b], d.add_row_to(int(ids[b]), rout0[b].copy()), f"gather {b}")


# ------------------------------------------- factors past the L2: grouped blocks


def _rank_past_l2(rows, cols, itemsize, members=1):
    """A rank whose factors (per member of `members`) overflow half of one core's L2 together,
    so that prefill runs its blocks in groups (blocks.c reads such factors once per group);
    256 KiB when the L2 is unknown, as blocks.c assumes."""
    l2 = lib.lora_team_l2_bytes() or 256 << 10
    return -(-l2 // (2 * members * (rows + cols) * itemsize)) + 3


@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_blocks_keep_the_bits(threads, isa, dtype):
    """Factors past half the L2: prefill takes its 4-position blocks in groups that share one
    read of the factors.  Every batch row still equals add_to on it alone, for a delta, a stack
    (one member at scale 0), a DoRA delta, bfloat16 activations and a bfloat16 out, and a bank
    whose adapters and scales (some 0) change inside a group."""
    if threads == 2 and not TWO:
        pytest.skip("one thread only")
    rng = np.random.default_rng(21)
    rows, cols = 1536, 512
    w = np.dtype(np.float32 if dtype == "float32" else np.float16).itemsize
    rank = _rank_past_l2(rows, cols, w)
    d = make_delta(rng, rank, rows, cols, dtype, alpha=2.0 * rank, wscale=0.05)
    st_ranks = _rank_past_l2(rows, cols, w, members=3)
    stack = lora.LoraStack([make_delta(rng, st_ranks, rows, cols, dtype, wscale=0.05),
                            make_delta(rng, 5, rows, cols, "float32", scale=0.0),
                            make_delta(rng, st_ranks + 7, rows, cols, dtype, wscale=0.05),
                            make_delta(rng, st_ranks, rows, cols, "bfloat16", scale=-0.5,
                                       wscale=0.05)])
    a, b = rng.standard_normal((rank, cols)) * 0.05, rng.standard_normal((rows, rank)) * 0.05
    base = rng.standard_normal((rows, cols)).astype(np.float32)
    dora = lora.DoraDelta(a, b, np.abs(rng.standard_normal(rows)) + 0.5, base, alpha=float(rank),
                          dtype=dtype)
    n_max = 130
    x_all, out_all = rand(rng, (n_max, cols)), rand(rng, (n_max, rows))
    sizes = list(range(1, 18)) + [33, 64, n_max]
    with num_threads(threads):
        for name, entry in (("delta", d), ("stack", stack), ("dora", dora)):
            singles = [apply("add_to", entry, x_all[i], out_all[i].copy()) for i in range(n_max)]
            for n in sizes:
                got = apply("add_batch_to", entry, x_all[:n], out_all[:n].copy())
                for i in range(n):
                    assert_same_bits(got[i], singles[i], f"{name} batch {n} row {i}")
        if BF16 is not None:  # half activations and a half out, widened strip by strip
            xb, ob = x_all.astype(BF16), out_all.astype(BF16)
            singles = [d.add_to(xb[i], ob[i].copy()) for i in range(n_max)]
            got = d.add_batch_to(xb, ob.copy())
            for i in range(n_max):
                assert_same_bits(got[i].view(np.uint16), singles[i].view(np.uint16), f"bf16 row {i}")
        # a bank: the adapter and the scale change inside what would be one group
        other = make_delta(rng, rank, rows, cols, dtype, alpha=float(rank), wscale=0.05)
        bank = lora.LoraBank([d, other, stack])
        ids = np.repeat(rng.integers(-1, 3, n_max // 3 + 1), 3)[:n_max]
        scales = rng.choice([0.0, 1.0, -0.5, 2.0], n_max)
        got = bank.add_batch_to(x_all, out_all.copy(), ids, scales)
        for i in range(n_max):
            want = out_all[i].copy()
            if ids[i] >= 0 and scales[i] != 0.0:
                one = lora.LoraBank([bank[int(ids[i])]])
                one.add_batch_to(x_all[i:i + 1], want[None], [0], [scales[i]])
            assert_same_bits(got[i], want, f"bank row {i} (adapter {ids[i]}, scale {scales[i]})")
