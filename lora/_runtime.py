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
    previous = isa()
    code = ISA_CODES.get(name)
    if code is None or lib.lora_set_isa(code) != lib.LORA_OK:
        raise ValueError(f"ISA {name!r} is not available here; available: {available_isas()}")
    return previous


def _user_stacklevel():
    """The stacklevel of the first frame outside this package and the import machinery, so an
    import-time warning points at the user's `import lora`."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None:
        internal = frame.f_code.co_filename.startswith("<frozen")  # warnings skips these itself
        if not internal and frame.f_globals.get("__name__", "").split(".")[0] != "lora":
            return level
        frame = frame.f_back
        level += 0 if internal or frame is None else 1
    return level


def _apply_env_isa():
    """LORA_ISA=scalar|avx2|avx512|neon can only lower the choice; an unknown name or a path
    this CPU or build cannot run warns (RuntimeWarning) and keeps the best path."""
    want = os.environ.get("LORA_ISA", "").strip().lower()
    if not want:
        return
    best = ISA_NAMES[lib.lora_best_isa()]
    if want not in ISA_CODES:
        warnings.warn(f"LORA_ISA={want!r} is not a known ISA path (scalar, avx2, avx512, neon); "
                      f"using {best}", RuntimeWarning, stacklevel=_user_stacklevel())
    elif not lib.lora_isa_supported(ISA_CODES[want]):
        warnings.warn(f"LORA_ISA={want!r} is not supported by this CPU or build "
                      f"(available: {', '.join(available_isas())}); using {best}",
                      RuntimeWarning, stacklevel=_user_stacklevel())
    else:
        lib.lora_set_isa(ISA_CODES[want])


_apply_env_isa()


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
    synchronisation (from ``lib.lora_team_min_work_past_l2()`` when the bytes it reads (the adapter
    factors, x and out) exceed one core's L2 cache, ``lib.lora_team_l2_bytes()``: then each core reads its share from
    its own L2, or keeps a stream from memory in flight), and only while team calls beat one
    thread; after two in a row that did not
    (other work holding the cores), calls run on one thread for a back-off of 10 ms to 2 s, and
    the team call that ends it only wakes the team (it is not judged).  ``OMP_WAIT_POLICY`` is
    the user's: the library never sets it.
    """
    if not lib.lora_openmp():
        return "one thread (built without OpenMP)"
    n = get_num_threads()
    if n == 1:
        return "one thread (the cap is 1: set_num_threads, OMP_NUM_THREADS or threadpoolctl)"
    floor, l2 = lib.lora_team_min_work(), lib.lora_team_l2_bytes()
    past = lib.lora_team_min_work_past_l2()
    text = (f"adaptive: up to {n} threads for calls of at least 2^{floor.bit_length() - 1} "
            f"multiply-adds per team synchronisation")
    if l2 > 0:
        text += (f" (2^{past.bit_length() - 1} when the bytes it reads exceed one core's "
                 f"{_size(l2)} L2)")
    text += (", one thread for 10 ms-2 s after two team calls in a row that were not faster "
             "than one thread")
    wait = os.environ.get("OMP_WAIT_POLICY", "").strip()
    text += f"; OMP_WAIT_POLICY={wait} (yours)" if wait else "; OpenMP wait policy: default"
    left = lib.lora_team_backoff()
    if left > 0:
        text += f"; now one thread for {left:.2f} s more (cores contended)"
    return text


def kernel_info():
    """What the extension runs on: a dict with ``isa`` (the path in use), ``available_isas``,
    ``openmp`` (bool), ``threads`` (``get_num_threads()``, the most a call uses),
    ``thread_policy`` (``thread_policy()``), ``fork_safe_openmp`` (bool: ``fork()`` releases the
    forking thread's OpenMP pool first, so a threaded op of any library sharing the runtime works
    in the child; see docs/guarantees.md), ``compiler`` and ``version``."""
    return {
        "isa": isa(),
        "available_isas": available_isas(),
        "openmp": bool(lib.lora_openmp()),
        "threads": get_num_threads(),
        "thread_policy": thread_policy(),
        "fork_safe_openmp": bool(lib.lora_fork_releases_pool()),
        "compiler": ffi.string(lib.lora_compiler()).decode("ascii", "replace"),
        "version": __version__,
    }
