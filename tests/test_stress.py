"""Concurrency stress, and the home of the shared-scale guarantee: many Python threads, scale
flips, thread-count flips.

The kernels release the GIL, so Python threads really run them at once, each opening its own
OpenMP team above the work threshold.  What must hold (docs/guarantees.md: the scale is read
once per call; deterministic and batch-invariant):

- every output equals a result computed serially with the old or with the new scale -- bit for
  bit, never a mix of the two within one call (a "torn" result);
- a thread flipping ``lora.set_num_threads`` meanwhile changes no bits;
- one LoraScale shared by several deltas is read at every call, once per call.
(fork() after OpenMP work: tests/test_threads.py.)

Bounded: every test stops after a few seconds (``LORA_STRESS_SECONDS``, default 2.0 per test) or a
fixed number of calls, whichever comes first; the whole module stays well under 30 s, also in the
sanitizer build.
"""

import os
import sys
import threading
import time

import numpy as np
import pytest

import lora
from lora._lora_cffi import lib
from conftest import assert_same_bits, can_run_two_threads, make_delta, rand

SECONDS = float(os.environ.get("LORA_STRESS_SECONDS", "2.0"))
N_WORKERS = 6
MAX_CALLS_PER_WORKER = 4000
SCALE_VALUES = (1.0, -0.5)   # LoraScale S flips between these
OTHER_VALUES = (2.0, 0.25)   # LoraScale T flips between these

# Shapes: one far below the team work floor (lib.lora_team_min_work() multiply-adds: every call
# stays on the calling thread), one at it (every rank-16 call opens a team, nested under the
# Python threads, unless the team policy is backing off): a single position of rank x (rows +
# cols) and the 7 token rows of the fixture (two blocks, rank x cols x 7 / 2 each) reach it.
FLOOR = lib.lora_team_min_work()
SMALL = dict(rank=8, rows=33, cols=17)
_LARGE_COLS = -(-2 * FLOOR // (16 * 7)) | 1
LARGE = dict(rank=16, rows=max(-(-FLOOR // 16) - _LARGE_COLS, 1) | 1, cols=_LARGE_COLS)


def _delta(rng, rank, rows, cols, scale, alpha=0.0, dtype="float32"):
    a = rng.standard_normal((rank, cols)).astype(np.float32)
    b = rng.standard_normal((rows, rank)).astype(np.float32)
    return lora.LoraDelta(a, b, alpha=alpha, scale=scale, dtype=dtype)


class _Fixture:
    """Deltas, stacks and a bank over shared scales, and every op they are stressed with."""

    def __init__(self, shape, seed):
        rng = np.random.default_rng(seed)
        self.S = lora.LoraScale(SCALE_VALUES[0])
        self.T = lora.LoraScale(OTHER_VALUES[0])
        rank, rows, cols = shape["rank"], shape["rows"], shape["cols"]
        # d1, d2 share S (two targets of one adapter on one base, as PEFT and GGUF files give
        # per layer); d3 has its own scale T; d4 stores bfloat16.
        self.d1 = _delta(rng, rank, rows, cols, self.S, alpha=2.0 * rank)
        self.d2 = _delta(rng, rank // 2, rows, cols, self.S, alpha=rank / 2)
        self.d3 = _delta(rng, rank, rows, cols, self.T)
        self.d4 = _delta(rng, rank, rows, cols, self.S, dtype="bfloat16")
        self.mixed_stack = lora.LoraStack([self.d1, self.d3])    # different scales
        self.shared_stack = lora.LoraStack([self.d1, self.d2])   # one scale, two deltas
        # each LoraScale appears once among the bank's deltas (S: d4, T: d3); shared_bank below
        # holds S three times (test_shared_scale_* )
        self.bank = lora.LoraBank([self.d4, None, self.d3])
        self.shared_bank = lora.LoraBank([self.d1, self.mixed_stack, None, self.d4, self.d3])
        batch = 7
        self.x1 = rng.standard_normal(cols).astype(np.float32)
        self.xb = rng.standard_normal((batch, cols)).astype(np.float32)
        self.ids = rng.integers(0, rows, size=batch)
        self.aids = np.array([0, 1, -1, 2, 2, 1, 0])
        self.shared_aids = np.array([0, 1, -1, 3, 4, 2, 1])
        self.o1 = rng.standard_normal(rows).astype(np.float32)
        self.ob = rng.standard_normal((batch, rows)).astype(np.float32)
        self.orows = rng.standard_normal((batch, cols)).astype(np.float32)
        # op name -> (callable(out) -> out, initial out, the scales whose values it may read)
        self.ops = {
            "delta.add_to": (lambda o: self.d1.add_to(self.x1, o), self.o1, ("S",)),
            "delta.add_batch_to": (lambda o: self.d1.add_batch_to(self.xb, o), self.ob, ("S",)),
            "bf16.add_batch_to": (lambda o: self.d4.add_batch_to(self.xb, o), self.ob, ("S",)),
            "delta.add_rows_to": (lambda o: self.d1.add_rows_to(self.ids, o), self.orows, ("S",)),
            "other.add_batch_to": (lambda o: self.d3.add_batch_to(self.xb, o), self.ob, ("T",)),
            "mixed_stack.add_batch_to": (lambda o: self.mixed_stack.add_batch_to(self.xb, o),
                                         self.ob, ("S", "T")),
            "mixed_stack.add_rows_to": (lambda o: self.mixed_stack.add_rows_to(self.ids, o),
                                        self.orows, ("S", "T")),
            "bank.add_batch_to": (lambda o: self.bank.add_batch_to(self.xb, o, self.aids),
                                  self.ob, ("S", "T")),
            "bank.add_rows_to": (lambda o: self.bank.add_rows_to(self.ids, o, self.aids),
                                 self.orows, ("S", "T")),
        }
        self.shared_ops = {
            "shared_stack.add_batch_to": (lambda o: self.shared_stack.add_batch_to(self.xb, o),
                                          self.ob, ("S",)),
            "shared_stack.add_to": (lambda o: self.shared_stack.add_to(self.x1, o), self.o1,
                                    ("S",)),
            "shared_bank.add_batch_to": (
                lambda o: self.shared_bank.add_batch_to(self.xb, o, self.shared_aids), self.ob,
                ("S", "T")),
            "shared_bank.add_rows_to": (
                lambda o: self.shared_bank.add_rows_to(self.ids, o, self.shared_aids), self.orows,
                ("S", "T")),
        }

    def set_scales(self, s, t):
        self.S.set(s)
        self.T.set(t)

    def expected(self, ops):
        """Serial results for every combination of scale values: op -> {bytes of result}."""
        allowed = {name: set() for name in ops}
        for s in SCALE_VALUES:
            for t in OTHER_VALUES:
                self.set_scales(s, t)
                for name, (fn, init, _) in ops.items():
                    allowed[name].add(fn(init.copy()).tobytes())
        self.set_scales(SCALE_VALUES[0], OTHER_VALUES[0])
        return allowed


def _hammer(fx, ops, allowed, *, flip_scales=True, flip_threads=False, seconds=SECONDS):
    """N_WORKERS threads call random ops while flippers change scales / thread counts.

    Returns (calls made, list of (op, bytes) that matched no serial result, exceptions)."""
    stop = threading.Event()
    bad, errors, calls = [], [], [0] * N_WORKERS
    names = sorted(ops)

    def worker(w):
        rng = np.random.default_rng(1000 + w)
        try:
            while not stop.is_set() and calls[w] < MAX_CALLS_PER_WORKER:
                name = names[rng.integers(len(names))]
                fn, init, _ = ops[name]
                got = fn(init.copy()).tobytes()
                calls[w] += 1
                if got not in allowed[name]:
                    bad.append((name, got))
        except BaseException as exc:  # reported by the test, never lost in the thread
            errors.append(exc)

    def scale_flipper():
        i = 0
        while not stop.is_set():
            i += 1
            fx.S.set(SCALE_VALUES[i % 2])
            if i % 3 == 0:
                fx.T.value = OTHER_VALUES[(i // 3) % 2]

    def thread_flipper():
        i = 0
        while not stop.is_set():
            i += 1
            lora.set_num_threads(1 if i % 2 else 64)
            time.sleep(0.0005)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many more GIL hand-offs, so more interleavings per second
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(N_WORKERS)]
    if flip_scales:
        threads.append(threading.Thread(target=scale_flipper))
    if flip_threads:
        threads.append(threading.Thread(target=thread_flipper))
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(c < MAX_CALLS_PER_WORKER for c in calls):
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        sys.setswitchinterval(old_interval)
        lora.set_num_threads(1 << 20)
        fx.set_scales(SCALE_VALUES[0], OTHER_VALUES[0])
    assert not any(t.is_alive() for t in threads), "a stress thread did not finish (hang?)"
    return sum(calls), bad, errors


@pytest.mark.skipif(not can_run_two_threads(), reason="OpenMP gives this process 1 thread")
def test_large_shape_opens_teams():
    """The premise of the "omp-teams" cases: called alone, their rank-16 ops open a team, and
    no op of the small shape does."""
    def team_calls():
        calls, lost = lora._runtime.ffi.new("int64_t *"), lora._runtime.ffi.new("int64_t *")
        lib.lora_team_stats(calls, lost)
        return calls[0]

    # (not bank.add_rows_to: a bank cuts positions into blocks per adapter, and its 7 token rows
    # over two adapters make blocks of at most 3 rows, each below the floor)
    names = ["delta.add_to", "delta.add_batch_to", "bf16.add_batch_to", "delta.add_rows_to",
             "other.add_batch_to", "mixed_stack.add_batch_to", "mixed_stack.add_rows_to",
             "bank.add_batch_to"]
    for shape, team in ((LARGE, True), (SMALL, False)):
        fx = _Fixture(shape, seed=3)
        for name in names:
            fn, init, _ = fx.ops[name]
            lib.lora_team_reset()
            try:
                fn(init.copy())
                assert (team_calls() > 0) == team, (shape, name, team_calls())
            finally:
                lib.lora_team_reset()


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["below-omp-threshold", "omp-teams"])
def test_threads_with_scale_flips_never_tear(shape):
    fx = _Fixture(shape, seed=1)
    allowed = fx.expected(fx.ops)
    calls, bad, errors = _hammer(fx, fx.ops, allowed)
    assert not errors, errors[:3]
    assert calls >= 50, f"only {calls} calls in {SECONDS} s"
    assert not bad, (f"{len(bad)} of {calls} results match no serial old-/new-scale result; "
                     f"ops: {sorted({n for n, _ in bad})}")


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["below-omp-threshold", "omp-teams"])
def test_thread_count_flips_change_no_bits(shape):
    """set_num_threads from another thread mid-stream: results identical to serial ones."""
    fx = _Fixture(shape, seed=2)
    allowed = fx.expected(fx.ops)
    calls, bad, errors = _hammer(fx, fx.ops, allowed, flip_scales=False, flip_threads=True)
    assert not errors, errors[:3]
    assert not bad, f"{len(bad)} of {calls} results differ from the serial bits: {sorted({n for n, _ in bad})}"


class _FlipOnRead(lora.LoraScale):
    """A LoraScale that "another thread" sets right after every read: the interleaving a real
    thread can produce whenever the GIL is released between two reads, made deterministic."""

    __slots__ = ("_values", "_reads")

    def __init__(self, values):
        self._values, self._reads = tuple(values), 0
        super().__init__(values[0])

    @property
    def _value(self):
        v = self._values[self._reads % len(self._values)]
        self._reads += 1
        return v

    @_value.setter
    def _value(self, v):
        pass


def _shared_scale_pair(scale):
    """Two deltas of one adapter on one base (they share `scale`), always the same weights."""
    rng = np.random.default_rng(11)
    return (_delta(rng, 8, 33, 17, scale, alpha=16.0), _delta(rng, 4, 33, 17, scale, alpha=2.0))


def _shared_scale_cases():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((6, 17)).astype(np.float32)
    ids = rng.integers(0, 33, size=6)
    aids = np.array([0, 1, 0, 1, 1, 0])
    return {
        "stack.add_batch_to": lambda p: lora.LoraStack(p).add_batch_to(
            x, np.zeros((6, 33), np.float32)),
        "stack.add_rows_to": lambda p: lora.LoraStack(p).add_rows_to(
            ids, np.zeros((6, 17), np.float32)),
        "bank.add_batch_to": lambda p: lora.LoraBank(p).add_batch_to(
            x, np.zeros((6, 33), np.float32), aids),
        "bank.add_rows_to": lambda p: lora.LoraBank(p).add_rows_to(
            ids, np.zeros((6, 17), np.float32), aids),
    }


def test_shared_scale_is_read_at_every_call(isa, dtype):
    """One LoraScale shared by several deltas: set() changes every effective_scale and every
    result at once, recomputing nothing."""
    rng = np.random.default_rng(12)
    s = lora.LoraScale(1.0)
    ds = [make_delta(rng, r, 16, 24, dtype, alpha=2.0 * r, scale=s) for r in (2, 4, 8)]
    assert all(d.scale is s for d in ds)
    x = rand(rng, 24)
    base = [d.add_to(x, np.zeros(16, np.float32)) for d in ds]
    for v in (0.5, -3.0, 2.0, 0.0, 1.0):
        s.set(v)
        assert s.value == v and s.get() == v and float(s) == v
        for d, b0 in zip(ds, base):
            assert d.effective_scale == v * 2.0
            got = d.add_to(x, np.zeros(16, np.float32))
            want = lora.LoraDelta(*d.lora_weights(), scale=v * 2.0, dtype=dtype).add_to(
                x, np.zeros(16, np.float32))
            assert_same_bits(got, want, f"scale {v}")
    s.value = 0.25
    assert all(d.effective_scale == 0.5 for d in ds)


@pytest.mark.parametrize("case", sorted(_shared_scale_cases()))
def test_shared_scale_is_read_once_per_call(case):
    """Deltas sharing one LoraScale in a stack or a bank: one value for the whole call.

    (Found by this module: stacks and banks used to read the scale once per delta, so a scale
    set between two reads gave one call both values.)"""
    fn = _shared_scale_cases()[case]
    allowed = {fn(_shared_scale_pair(lora.LoraScale(s))).tobytes() for s in SCALE_VALUES}
    got = fn(_shared_scale_pair(_FlipOnRead(SCALE_VALUES)))
    assert got.tobytes() in allowed, f"{case}: one call mixed two values of one LoraScale"


def test_shared_scale_under_real_threads():
    """The same property with real threads: stacks and a bank whose deltas share the scale S
    that a flipper thread changes (before the fix, about 1 call in 10^4 tore)."""
    fx = _Fixture(SMALL, seed=4)
    allowed = fx.expected(fx.shared_ops)
    calls, bad, errors = _hammer(fx, fx.shared_ops, allowed)
    assert not errors, errors[:3]
    assert not bad, f"{len(bad)} of {calls} results mix two values of one LoraScale: " \
                    f"{sorted({n for n, _ in bad})}"


def test_many_threads_many_deltas_match_serial():
    """Different deltas per thread (no scale flips): every thread's results equal its serial ones."""
    rng = np.random.default_rng(5)
    deltas = [_delta(rng, 4 + 4 * i, 257 + i, 129 + 2 * i, 1.0 + i, dtype=dt)
              for i, dt in enumerate(["float32", "float16", "bfloat16"] * 3)]
    inputs = [(rng.standard_normal((5, d.cols)).astype(np.float32),
               rng.integers(0, d.rows, size=5)) for d in deltas]
    serial = [(d.add_batch_to(x, np.zeros((5, d.rows), np.float32)),
               d.add_rows_to(ids, np.zeros((5, d.cols), np.float32)))
              for d, (x, ids) in zip(deltas, inputs)]
    bad, errors = [], []
    deadline = time.monotonic() + SECONDS

    def worker(i):
        d, (x, ids) = deltas[i], inputs[i]
        try:
            for _ in range(500):
                if time.monotonic() > deadline:
                    break
                a = d.add_batch_to(x, np.zeros((5, d.rows), np.float32))
                b = d.add_rows_to(ids, np.zeros((5, d.cols), np.float32))
                if not (np.array_equal(a, serial[i][0]) and np.array_equal(b, serial[i][1])):
                    bad.append(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(deltas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    assert not errors, errors[:3]
    assert not bad, f"deltas {sorted(set(bad))} gave results differing from their serial bits"
