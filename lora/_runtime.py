"""The compiled extension, ISA choice, threads and kernel_info()."""

import os
import warnings

from ._lora_cffi import ffi, lib

__all__ = ["set_num_threads", "get_num_threads", "kernel_info"]

__version__ = "0.1.0"

ISA_CODES = {
    "scalar": lib.LORA_ISA_SCALAR,
    "avx2": lib.LORA_ISA_AVX2,
    "avx512": lib.LORA_ISA_AVX512,
    "neon": lib.LORA_ISA_NEON,
}
ISA_NAMES = {code: name for name, code in ISA_CODES.items()}


def available_isas():
    """The ISA paths this CPU and build can run, lowest first."""
    return [name for name, code in ISA_CODES.items() if lib.lora_isa_supported(code)]


def isa():
    """The ISA path in use ("scalar", "avx2", "avx512" or "neon")."""
    return ISA_NAMES[lib.lora_get_isa()]


def set_isa(name):
    """Switch the ISA path for the whole process (tests use this); returns the previous name.

    Raises ``ValueError`` for a path this CPU or build cannot run.  Unlike ``LORA_ISA`` it never
    falls back silently: a test that asks for avx512 must get avx512.
    """
    global _forced_by
    previous = isa()
    code = ISA_CODES.get(name)
    if code is None or lib.lora_set_isa(code) != lib.LORA_OK:
        raise ValueError(f"ISA {name!r} is not available here; available: {available_isas()}")
    _forced_by = f"set_isa({name!r})"
    return previous


_forced_by = None  # what last forced the path: "LORA_ISA=..." or "set_isa(...)"


def _cpu_row():
    """This CPU's cpuid id, the path the load-time choice gives it, and its table row's name
    and evidence (None without a row) -- the C choice's own lookup, lora_isa_for_cpu."""
    vendor, ints = ffi.new("char[13]"), [ffi.new("int *") for _ in range(3)]
    known = lib.lora_cpu_id(vendor, *ints)
    name, evidence = ffi.new("const char *[1]"), ffi.new("const char *[1]")
    default = lib.lora_isa_for_cpu(vendor, ints[0][0], ints[1][0], lib.lora_best_isa(), name,
                                   evidence)

    def text(p):
        return None if p == ffi.NULL else ffi.string(p).decode("ascii", "replace")

    cpu = {"vendor": ffi.string(vendor).decode("ascii", "replace") if known else None,
           "family": ints[0][0] if known else None, "model": ints[1][0] if known else None,
           "stepping": ints[2][0] if known else None, "name": text(name[0])}
    return cpu, ISA_NAMES[default], text(evidence[0])


def isa_reason(row=None):
    """Why the path in use runs (``kernel_info()["isa_reason"]``): ``"table: <core>, <evidence>"``
    (a measured CPU model's row chose it), ``"flags: ..."`` (the widest path the CPU's feature
    bits allow; a row that only names the core says so) or ``"LORA_ISA=<name> ..."`` /
    ``"set_isa(<name>) ..."`` (forced).  `row`: ``_cpu_row()``, if already read."""
    cpu, default, evidence = row or _cpu_row()
    source = lib.lora_isa_source()
    if source == lib.LORA_ISA_FROM_TABLE:
        return f"table: {cpu['name']}, {evidence}"
    flags = "flags: the widest path this CPU and build support"
    if cpu["name"]:
        flags += f"; the CPU table's row {cpu['name']} keeps it: {evidence}"
    elif cpu["vendor"]:
        flags += "; no CPU table row for this model"
    if source == lib.LORA_ISA_FROM_FLAGS:
        return flags
    why = "table" if default != ISA_NAMES[lib.lora_best_isa()] else "flags"
    return f"{_forced_by or 'lora_set_isa'} (the default here: {default}, by {why})"


def _user_stacklevel():
    """The stacklevel of the first frame outside this package and the import machinery, so an
    import-time warning points at the user's `import lora`; None when there is none (``python
    -m lora``: runpy imports the package, no line of the user's does)."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None:
        internal = frame.f_code.co_filename.startswith("<frozen")  # warnings skips these itself
        if not internal and frame.f_globals.get("__name__", "").split(".")[0] != "lora":
            return level
        frame = frame.f_back
        level += 0 if internal or frame is None else 1
    return None


_DEFERRED = []  # import-time warnings of `python -m lora`, which its CLI prints (take_warnings)


def _warn(message):
    """An import-time RuntimeWarning at the user's `import lora` line.  Under ``python -m
    lora`` there is none (sys.argv[0] is "-m" while runpy imports the package): the CLI prints
    it as its own warning line (`take_warnings`), else it is shown when the interpreter exits;
    anywhere else without a caller's frame (an embedding application), at this line."""
    import sys

    level = _user_stacklevel()
    if level is None and sys.argv[:1] == ["-m"]:
        if not _DEFERRED:
            import atexit

            atexit.register(_flush)
        _DEFERRED.append(message)
        return
    warnings.warn(message, RuntimeWarning, stacklevel=level or 1)


def take_warnings():
    """The import-time warnings deferred for ``python -m lora`` to print (and forget)."""
    taken = list(_DEFERRED)
    _DEFERRED.clear()
    return taken


def _flush():
    for message in take_warnings():  # a `python -m lora.<module>` that did not take them
        warnings.warn(message, RuntimeWarning)


def _apply_env_isa():
    """LORA_ISA=scalar|avx2|avx512|neon forces that path when this CPU and build run it (even
    one above a table row's choice); an unknown name or a path this CPU or build cannot run
    warns (RuntimeWarning) and keeps the default path."""
    global _forced_by
    want = os.environ.get("LORA_ISA", "").strip().lower()
    if not want:
        return
    default = isa()
    if want not in ISA_CODES:
        _warn(f"LORA_ISA={want!r} is not a known ISA path (scalar, avx2, avx512, neon); "
              f"using {default}")
    elif not lib.lora_isa_supported(ISA_CODES[want]):
        _warn(f"LORA_ISA={want!r} is not supported by this CPU or build "
              f"(available: {', '.join(available_isas())}); using {default}")
    else:
        lib.lora_set_isa(ISA_CODES[want])
        _forced_by = f"LORA_ISA={want}"


_apply_env_isa()

Q8_0_WIDENINGS = {"shuffle": lib.LORA_Q8_0_WIDEN_SHUFFLE, "cvt": lib.LORA_Q8_0_WIDEN_CVT}
_Q8_0_WIDENING_NAMES = {code: name for name, code in Q8_0_WIDENINGS.items()}
_q8_0_forced_by = None  # "LORA_Q8_0_WIDENING=..." or "set_q8_0_widening(...)"


def q8_0_widening():
    """How the AVX-512 path builds q8_0 values in its hot loops: "shuffle" or "cvt" (the same
    bits either way; the CPU table picks the faster one per core)."""
    return _Q8_0_WIDENING_NAMES[lib.lora_q8_0_widening()]


def _table_q8_0_widening(cpu):
    """The q8_0 build the CPU table gives this CPU (`cpu`: ``_cpu_row()[0]``)."""
    vendor = ffi.new("char[]", (cpu["vendor"] or "").encode("ascii"))
    family, model = (-1 if cpu[k] is None else cpu[k] for k in ("family", "model"))
    return _Q8_0_WIDENING_NAMES[lib.lora_q8_0_widening_for_cpu(vendor, family, model)]


def set_q8_0_widening(name):
    """Switch the q8_0 build for the whole process (tests and benchmarks use this); returns the
    previous name.  ``None`` goes back to the CPU table's choice (and its reason).  Raises
    ``ValueError`` for anything else than "shuffle", "cvt" or None."""
    global _q8_0_forced_by
    if name is not None and (not isinstance(name, str) or name not in Q8_0_WIDENINGS):
        raise ValueError(f"q8_0 widening {name!r} is not one of {sorted(Q8_0_WIDENINGS)} or None")
    previous = q8_0_widening()
    if name is None:
        lib.lora_set_q8_0_widening(Q8_0_WIDENINGS[_table_q8_0_widening(_cpu_row()[0])])
        _q8_0_forced_by = None
    else:
        lib.lora_set_q8_0_widening(Q8_0_WIDENINGS[name])
        _q8_0_forced_by = f"set_q8_0_widening({name!r})"
    return previous


def _apply_env_q8_0_widening():
    """LORA_Q8_0_WIDENING=shuffle|cvt replaces the CPU table's q8_0 build; an unknown name warns
    (RuntimeWarning) and keeps the table's."""
    global _q8_0_forced_by
    want = os.environ.get("LORA_Q8_0_WIDENING", "").strip().lower()
    if not want:
        return
    if want not in Q8_0_WIDENINGS:
        _warn(f"LORA_Q8_0_WIDENING={want!r} is not a known q8_0 build (shuffle, cvt); "
              f"using {q8_0_widening()}")
        return
    lib.lora_set_q8_0_widening(Q8_0_WIDENINGS[want])
    _q8_0_forced_by = f"LORA_Q8_0_WIDENING={want}"


_apply_env_q8_0_widening()


def q8_0_widening_reason(row=None):
    """The q8_0 build in use and why (``kernel_info()["q8_0_widening"]``)."""
    cpu = (row or _cpu_row())[0]
    default = _table_q8_0_widening(cpu)
    used = q8_0_widening()
    if _q8_0_forced_by:
        text = f"{used}: {_q8_0_forced_by} (the default here: {default})"
    elif cpu["name"]:
        text = f"{used}: the CPU table's row {cpu['name']}"
    else:
        text = f"{used}: the default without a CPU table row"
    return text if isa() == "avx512" else f"{text}; unused on the {isa()} path (it has one build)"


def set_num_threads(n):
    """Cap the threads every kernel call may use, process-wide.

    ``n`` must be an int >= 1 (``TypeError`` / ``ValueError`` otherwise).  The threads a call may
    use are ``min(n, omp_get_max_threads(), OMP_THREAD_LIMIT)`` read at that call, passed as an
    OpenMP ``num_threads`` clause, so ``OMP_NUM_THREADS`` and ``threadpoolctl`` limits keep
    working; the thread policy (`thread_policy`) decides per call whether to use more than one.
    Results are bit-identical for every thread count.
    """
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"set_num_threads needs an int >= 1, got {type(n).__name__}")
    n = n.__index__()
    if n < 1:
        raise ValueError(f"set_num_threads needs an int >= 1, got {n}")
    lib.lora_set_num_threads(min(n, 1 << 30))


def get_num_threads():
    """The most threads a kernel call may use right now: ``min(set_num_threads cap,
    omp_get_max_threads(), OMP_THREAD_LIMIT)``; 1 in a build without OpenMP and in a child
    process after ``fork()``.  Small calls, and calls while the cores are contended, use one
    (see `thread_policy`)."""
    return lib.lora_get_num_threads()


def _size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def thread_policy():
    """One line saying how calls choose their threads right now (``kernel_info()["thread_policy"]``).

    A call opens a team only from ``lib.lora_team_min_work()`` multiply-adds per team
    synchronisation (2^18, or the floor the CPU table measured for this core; from
    ``lib.lora_team_min_work_past_l2()`` when the bytes it reads, the
    adapter factors with x and out, exceed one core's L2 cache, ``lib.lora_team_l2_bytes()``:
    then each core reads its share from its own L2, or keeps a stream from memory in flight),
    and only while team calls beat one thread: the time judged team calls lose against one
    thread is owed until calls that win repay it, and once two have run owing time (other work
    holding the cores), calls run on one thread for a back-off of 10 ms to 2 s, at least 100x
    the time the team calls since the team last paid took; the team call that ends it only
    wakes the team (its time counts in the next back-off, it is not judged).  ``OMP_WAIT_POLICY`` is
    the user's: the library never sets it.
    """
    if not lib.lora_openmp():
        return "one thread (built without OpenMP)"
    n = get_num_threads()
    if n == 1:
        return ("one thread (the cap is 1: set_num_threads, OMP_NUM_THREADS, threadpoolctl, or "
                "torch.set_num_threads where torch shares the OpenMP runtime)")
    floor, l2 = lib.lora_team_min_work(), lib.lora_team_l2_bytes()
    past = lib.lora_team_min_work_past_l2()
    # a power of two, unless lora_team_set_min_work set another value
    at = f"2^{floor.bit_length() - 1}" if floor & (floor - 1) == 0 else str(floor)
    text = (f"adaptive: up to {n} threads for calls of at least {at} multiply-adds per team "
            "synchronisation")
    cpu = _cpu_row()[0]
    table = lib.lora_team_floor_for_cpu((cpu["vendor"] or "").encode(), cpu["family"] or -1,
                                        cpu["model"] or -1)
    notes = []
    if floor == table:
        notes.append(f"the CPU table's floor for {cpu['name']}")
    elif floor != lib.lora_team_default_min_work():
        notes.append("set by lora_team_set_min_work")
    if l2 > 0 and past < floor:
        notes.append(f"2^{past.bit_length() - 1} when the bytes it reads exceed one core's "
                     f"{_size(l2)} L2")
    if notes:
        text += f" ({'; '.join(notes)})"
    text += (", one thread for 10 ms-2 s (at least 100x the team calls' time) once two team calls "
             "ran owing time they lost against one thread")
    wait = os.environ.get("OMP_WAIT_POLICY", "").strip()
    text += f"; OMP_WAIT_POLICY={wait} (yours)" if wait else "; OpenMP wait policy: default"
    left = lib.lora_team_backoff()
    if left > 0:
        text += f"; now one thread for {left:.2f} s more (cores contended)"
    return text


def kernel_info():
    """What the extension runs on: a dict with ``isa`` (the path in use), ``isa_reason``
    (`isa_reason()`: table, flags or forced, and why), ``cpu`` (cpuid's ``vendor``, ``family``,
    ``model``, ``stepping``: str / int, None where not read (aarch64); ``name``: the CPU table's
    name for it, None for a model without a row), ``available_isas``, ``openmp`` (bool),
    ``threads`` (``get_num_threads()``, the most a call uses), ``thread_policy``
    (``thread_policy()``), ``q8_0_widening`` (how the AVX-512 path builds q8_0 values, "shuffle"
    or "cvt", and why: the same bits either way), ``fork_safe_openmp`` (bool: ``fork()`` releases the forking thread's
    OpenMP pool first, so a threaded op of any library sharing the runtime works in the child;
    see docs/guarantees.md), ``compiler`` and ``version``."""
    row = _cpu_row()
    return {
        "isa": isa(),
        "isa_reason": isa_reason(row),
        "cpu": row[0],
        "available_isas": available_isas(),
        "openmp": bool(lib.lora_openmp()),
        "threads": get_num_threads(),
        "thread_policy": thread_policy(),
        "q8_0_widening": q8_0_widening_reason(row),
        "fork_safe_openmp": bool(lib.lora_fork_releases_pool()),
        "compiler": ffi.string(lib.lora_compiler()).decode("ascii", "replace"),
        "version": __version__,
    }
