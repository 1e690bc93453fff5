"""Threads (the thread policy of docs/guarantees.md): set_num_threads caps, OMP_NUM_THREADS and threadpoolctl
limits are obeyed, the GIL is released while a kernel runs, concurrent Python threads get the
same bits as serial calls, and a fork()ed child runs kernels instead of hanging."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import lora
from lora._lora_cffi import lib
from conftest import (PYTHON, assert_same_bits, can_run_two_threads, make_delta, num_threads,
                      rand, subprocess_env)

TWO = can_run_two_threads()


def test_set_num_threads_caps():
    top = lib.lora_get_num_threads() if lora.kernel_info()["openmp"] else 1
    with num_threads(1):
        assert lora.get_num_threads() == 1 and lib.lora_probe_threads() == 1
        assert lora.kernel_info()["threads"] == 1
    with num_threads(10**6):  # a cap above the OpenMP limit changes nothing
        assert lora.get_num_threads() == top
        assert lib.lora_probe_threads() == top
    if TWO:
        with num_threads(2):
            assert lora.get_num_threads() == 2 and lib.lora_probe_threads() == 2
    lora.set_num_threads(1)
    lora.set_num_threads(1)  # process-wide, idempotent
    assert lora.get_num_threads() == 1


def test_threadpoolctl_limits_our_threads():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not lora.kernel_info()["openmp"]:
        pytest.skip("serial build")
    before = lora.get_num_threads()
    with threadpoolctl.threadpool_limits(1):
        assert lora.get_num_threads() == 1
        assert lib.lora_probe_threads() == 1
        assert lora.kernel_info()["threads"] == 1
    assert lora.get_num_threads() == before
    if TWO:
        with threadpoolctl.threadpool_limits(1, user_api="openmp"):
            assert lib.lora_probe_threads() == 1
        with num_threads(2):
            assert lib.lora_probe_threads() == 2


def test_omp_num_threads_in_a_subprocess():
    code = "import lora; from lora._lora_cffi import lib; print(lora.get_num_threads(), " \
           "lib.lora_probe_threads(), lora.kernel_info()['threads'])"
    p = subprocess.run([PYTHON, "-c", code], env=subprocess_env(OMP_NUM_THREADS=1),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "1", "1"]
    if TWO:
        p = subprocess.run([PYTHON, "-c", code], env=subprocess_env(OMP_NUM_THREADS=2),
                           capture_output=True, text=True, timeout=120)
        assert p.stdout.split() == ["2", "2", "2"], p.stderr


def _long_call():
    """A delta and a batch whose add_batch_to takes ~0.3 s on one thread (calibrated).  Rank 1024
    makes each position ~2M multiply-adds, so the batch stays a few MiB."""
    rng = np.random.default_rng(1)
    d = make_delta(rng, 1024, 1024, 1024, "float32")
    x = rand(rng, (16, 1024))
    out = np.zeros((16, 1024), np.float32)
    d.add_batch_to(x, out)  # warm up
    t0 = time.perf_counter()
    d.add_batch_to(x, out)
    per = max(time.perf_counter() - t0, 1e-5)
    reps = int(min(max(0.3 / per, 1), 1000))
    big_x = np.tile(x, (reps, 1))
    return d, big_x, np.zeros_like(big_x)


def test_gil_is_released_during_a_kernel():
    """A second Python thread keeps running while one long C call runs.  No wall-clock
    threshold: a spinning thread records perf_counter() stamps; if the call held the GIL, no
    stamp could fall strictly inside the middle half of the call's [start, end] window."""
    with num_threads(1):
        d, x, out = _long_call()
        stamps = []
        stop = threading.Event()
        started = threading.Event()

        def spin():
            started.set()
            while not stop.is_set():
                stamps.append(time.perf_counter())

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)  # let the spinner get the GIL back quickly when released
        t = threading.Thread(target=spin)
        t.start()
        try:
            started.wait()
            time.sleep(0.01)
            start = time.perf_counter()
            d.add_batch_to(x, out)
            end = time.perf_counter()
        finally:
            stop.set()
            t.join()
            sys.setswitchinterval(old)
    q1, q3 = start + (end - start) / 4, end - (end - start) / 4
    inside = [s for s in stamps if q1 < s < q3]
    assert inside, (f"no progress in another thread during the middle half of a "
                    f"{end - start:.3f} s kernel call: the GIL was held")


def test_gil_probe_detects_a_held_gil():
    """The probe above is sound: a call that keeps the GIL (sum over a range, one C loop) lets
    no stamp into its middle half."""
    stamps = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.01)
        n = 10**6
        t0 = time.perf_counter()
        sum(range(n))
        n = int(n * 0.1 / max(time.perf_counter() - t0, 1e-6))
        start = time.perf_counter()
        sum(range(n))
        end = time.perf_counter()
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    q1, q3 = start + (end - start) / 4, end - (end - start) / 4
    assert not [s for s in stamps if q1 < s < q3]


def test_concurrent_python_threads_get_serial_bits():
    """Two Python threads calling kernels at once (different deltas, shared delta, banks) get
    exactly the bits of serial calls."""
    rng = np.random.default_rng(2)
    d1 = make_delta(rng, 16, 1024, 1024, "float32", alpha=16.0)
    d2 = make_delta(rng, 8, 1024, 1024, "bfloat16")
    bank = lora.LoraBank([d1, d2, None])
    jobs = []
    for i in range(6):
        x = rand(rng, (33, 1024))
        out0 = rand(rng, (33, 1024))
        aid = rng.integers(-1, 3, 33)
        ids = rng.integers(0, 1024, 33)
        jobs.append((x, out0, aid, ids))

    def work(job, d):
        x, out0, aid, ids = job
        return (d.add_batch_to(x, out0.copy()), d.add_to(x[0], out0[0].copy()),
                bank.add_batch_to(x, out0.copy(), aid), d.add_rows_to(ids, out0.copy()))

    serial = [work(j, d) for j in jobs for d in (d1, d2)]
    for threads in (1, 2):
        with num_threads(threads):
            results = [None] * len(serial)

            def runner(k0):
                for k in range(k0, len(serial), 2):
                    for _ in range(3):
                        results[k] = work(jobs[k // 2], (d1, d2)[k % 2])

            ts = [threading.Thread(target=runner, args=(k0,)) for k0 in (0, 1)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            for k, (got, want) in enumerate(zip(results, serial)):
                for g, w in zip(got, want):
                    assert_same_bits(g, w, f"job {k}, {threads} OpenMP threads")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork()")
def test_fork_after_openmp_work():
    """After OpenMP work in the parent, a fork()ed child runs a big add_batch_to and exits 0 with
    the right bits (a GNU OpenMP pool does not survive fork; the child must not hang on it)."""
    rng = np.random.default_rng(3)
    d = make_delta(rng, 16, 1024, 1024, "float32", alpha=16.0)
    x = rand(rng, (256, 1024))
    out0 = rand(rng, (256, 1024))
    with num_threads(2):
        expect = d.add_batch_to(x, out0.copy())  # the parent's pool is up now
        expect_one = d.add_to(x[0], out0[0].copy())
    lora.set_num_threads(2)
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            threads = lora.get_num_threads()
            got = d.add_batch_to(x, out0.copy())
            one = d.add_to(x[0], out0[0].copy())
            ok = got.tobytes() == expect.tobytes() and one.tobytes() == expect_one.tobytes()
            code = 0 if ok and threads == 1 else (2 if ok else 3)
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in a kernel call")
        time.sleep(0.02)
    assert os.WIFEXITED(status), status
    code = os.WEXITSTATUS(status)
    assert code != 3, "the child computed different bits"
    assert code != 2, "the child reports more than one thread after fork()"
    assert code == 0
    # the parent still works, with its threads
    with num_threads(2):
        assert_same_bits(d.add_batch_to(x, out0.copy()), expect, "parent after fork")


def test_num_threads_visible_in_kernel_info():
    with num_threads(1):
        assert lora.kernel_info()["threads"] == 1


# ---------------------------------------------------------------- the adaptive team policy
# Its decisions that do not depend on timing: the work floor, the caps, the back-off after a
# reported losing team (fed by hand through lora_team_report), and the wait policy left alone.

def _team_calls():
    calls, lost = lora._runtime.ffi.new("int64_t *"), lora._runtime.ffi.new("int64_t *")
    lib.lora_team_stats(calls, lost)
    return calls[0], lost[0]


@pytest.fixture
def fresh_policy():
    lib.lora_team_reset()
    yield
    lib.lora_team_reset()


def test_team_only_from_the_work_floor(fresh_policy):
    floor = lib.lora_team_min_work()
    assert floor > 1
    top = lora.get_num_threads()
    assert lib.lora_call_threads(floor - 1, 0) == 1
    assert lib.lora_call_threads(floor, 0) == top
    with num_threads(1):
        assert lib.lora_call_threads(1 << 40, 1 << 40) == 1
    threadpoolctl = pytest.importorskip("threadpoolctl")
    with threadpoolctl.threadpool_limits(1):
        assert lib.lora_call_threads(1 << 40, 1 << 40) == 1


def test_the_cpu_table_sets_a_cores_measured_floor():
    """Only a CPU table row with a measured floor replaces the default (Zen 4 Genoa: 2^17);
    this process runs its own core's floor, and thread_policy names the row that set it."""
    default = lib.lora_team_default_min_work()
    assert default == 1 << 18
    assert lib.lora_team_floor_for_cpu(b"AuthenticAMD", 25, 0x11) == 1 << 17
    for cpu in ((b"AuthenticAMD", 25, 1), (b"GenuineIntel", 6, 106), (b"AuthenticAMD", 25, 0x61),
                (b"GenuineIntel", 25, 0x11), (b"", -1, -1)):
        assert lib.lora_team_floor_for_cpu(*cpu) == 0, cpu
    cpu = lora.kernel_info()["cpu"]
    mine = lib.lora_team_floor_for_cpu((cpu["vendor"] or "").encode(), cpu["family"] or -1,
                                       cpu["model"] or -1)
    assert lib.lora_team_min_work() == (mine or default)
    assert lib.lora_team_min_work_past_l2() < lib.lora_team_min_work()
    if lora.kernel_info()["openmp"] and lora.get_num_threads() > 1:
        named = "the CPU table's floor for" in lora.kernel_info()["thread_policy"]
        assert named == bool(mine)


def test_a_set_floor_decides_until_it_is_cleared(fresh_policy):
    """lora_team_set_min_work replaces the floor (thread_policy says so, in its exact value);
    0 brings back this core's own."""
    mine = lib.lora_team_min_work()
    two = lora.kernel_info()["openmp"] and lora.get_num_threads() > 1
    try:
        lib.lora_team_set_min_work(1 << 14)
        assert lib.lora_team_min_work() == 1 << 14
        assert lib.lora_call_threads((1 << 14) - 1, 0) == 1
        assert lib.lora_call_threads(1 << 14, 0) == lora.get_num_threads()
        if two:
            policy = lora.kernel_info()["thread_policy"]
            assert "at least 2^14 multiply-adds" in policy and "set by lora_team_set_min_work" in policy
            assert "when the bytes it reads exceed" not in policy  # 2^16 is no lower floor now
        lib.lora_team_set_min_work(100000)
        if two:
            assert "at least 100000 multiply-adds" in lora.kernel_info()["thread_policy"]
    finally:
        lib.lora_team_set_min_work(0)
    assert lib.lora_team_min_work() == mine
    if two:
        assert "set by lora_team_set_min_work" not in lora.kernel_info()["thread_policy"]


def test_calls_past_one_cores_l2_open_a_team_from_the_lower_floor(fresh_policy):
    """Calls reading more than one core's L2 open a team from the lower floor (each core then
    reads its share from its own L2); calls that fit keep the plain floor; an unknown L2 (0)
    or uncounted bytes (0) keep it too."""
    floor, past = lib.lora_team_min_work(), lib.lora_team_min_work_past_l2()
    assert 1 < past < floor
    l2 = lib.lora_team_l2_bytes()
    assert l2 >= 0 and lib.lora_team_l2_bytes() == l2  # read once, then the same
    top = lora.get_num_threads()
    assert lib.lora_call_threads(past - 1, 1 << 40) == 1
    assert lib.lora_call_threads(floor - 1, 0) == 1
    if l2 == 0:
        assert lib.lora_call_threads(floor - 1, 1 << 40) == 1
        return
    assert lib.lora_call_threads(past, l2) == 1
    assert lib.lora_call_threads(past, l2 + 1) == top
    with num_threads(1):
        assert lib.lora_call_threads(past, l2 + 1) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the L2 size is read on Linux")
def test_the_l2_size_is_read_from_the_system():
    if not os.path.exists("/sys/devices/system/cpu/cpu0/cache/index0/level"):
        pytest.skip("no cache description in sysfs here")
    l2 = lib.lora_team_l2_bytes()
    assert l2 >= 64 << 10 and l2 % 1024 == 0, l2
    if lora.kernel_info()["openmp"] and lora.get_num_threads() > 1:  # else: one thread, no rule
        policy = lora.kernel_info()["thread_policy"]
        assert f"{l2 >> 10} KiB L2" in policy or f"{l2 >> 20} MiB L2" in policy, policy


@pytest.mark.skipif(not TWO, reason="needs two OpenMP threads")
def test_small_calls_never_open_a_team(fresh_policy):
    """A 4096 x 4096 decode is rank x 8192 multiply-adds: the rank at the work floor opens a
    team, half of it does not; 8 positions of 1024 x 1024 reach the floor in all but are two
    blocks of half of it each, and a team would meet at barriers in every block: one thread.
    The half-floor delta is stored in bfloat16 (256 KiB + 32 KiB of x and out), within one
    core's L2 on most CPUs, so the lower floor for calls past the L2 does not apply to it."""
    floor = lib.lora_team_min_work()
    r_team = floor // 8192
    assert r_team >= 2 and r_team % 2 == 0 and r_team * 8192 == floor, \
        f"the shapes below assume a floor that is an even multiple of 8192, not {floor}"
    if 0 < lib.lora_team_l2_bytes() < r_team // 2 * 8192 * 2 + 8192 * 4:
        pytest.skip("an L2 smaller than a 4096 x 4096 bfloat16 decode of half the floor")
    rng = np.random.default_rng(4)
    d_half = make_delta(rng, r_team // 2, 4096, 4096, "bfloat16")  # floor / 2: one thread
    d_team = make_delta(rng, r_team, 4096, 4096, "float32")        # the floor: a team
    small = make_delta(rng, r_team // 2, 1024, 1024, "float32")    # 8 positions: the floor
    x, out = rand(rng, 4096), np.zeros(4096, np.float32)
    d_half.add_to(x, out)
    small.add_batch_to(rand(rng, (8, 1024)), np.zeros((8, 1024), np.float32))
    assert _team_calls() == (0, 0)
    with num_threads(1):
        d_team.add_to(x, out)
    assert _team_calls() == (0, 0)
    d_team.add_to(x, out)
    assert _team_calls()[0] == 1


@pytest.mark.skipif(not TWO, reason="needs two OpenMP threads")
def test_a_decode_past_one_cores_l2_opens_a_team(fresh_policy):
    """A float32 decode below the plain floor whose factors, x and out exceed one core's L2
    runs on a team (each core reads half of them from its own L2), with the same bits as one thread."""
    floor, past, l2 = (lib.lora_team_min_work(), lib.lora_team_min_work_past_l2(),
                       lib.lora_team_l2_bytes())
    rank = max(2, -(-past // 8192))
    while (rank * 8192 + 8192) * 4 <= l2:  # factors, x and out
        rank += 2
    if l2 == 0 or rank * 8192 >= floor:
        pytest.skip(f"a {l2 >> 10} KiB L2: no 4096 x 4096 float32 decode below the plain floor "
                    "exceeds it")
    rng = np.random.default_rng(5)
    d = make_delta(rng, rank, 4096, 4096, "float32")
    x = rand(rng, 4096)
    with num_threads(1):
        one = d.add_to(x, np.zeros(4096, np.float32))
    assert _team_calls() == (0, 0)
    team = d.add_to(x, np.zeros(4096, np.float32))
    assert _team_calls()[0] == 1
    assert one.tobytes() == team.tobytes()


def test_a_losing_team_backs_off_to_one_thread(fresh_policy):
    top = lora.get_num_threads()
    big = 1 << 30
    lib.lora_team_report(1e-3, 1e-3)    # the first team call wakes the team: not judged
    assert lib.lora_team_backoff() == 0.0 and _team_calls() == (1, 0)
    lib.lora_team_report(0.5e-3, 1e-3)  # twice as fast as one thread: pays, no back-off
    assert lib.lora_team_backoff() == 0.0 and lib.lora_call_threads(big, 0) == top
    lib.lora_team_report(1e-3, 1e-3)    # no faster than one thread: lost, once
    assert _team_calls() == (3, 1) and lib.lora_team_backoff() == 0.0
    lib.lora_team_report(1e-3, 1e-3)    # lost twice in a row: back off
    assert _team_calls() == (4, 2)
    left = lib.lora_team_backoff()
    assert 0.1 < left <= 0.2            # 100x the two losing calls' 2 ms
    assert lib.lora_call_threads(big, 0) == 1
    if top > 1:
        assert "now one thread" in lora.kernel_info()["thread_policy"]
    lib.lora_team_report(100.0, 1.0)    # however slow the loser, the back-off stays bounded
    assert 0.0 < lib.lora_team_backoff() <= 2.0
    lib.lora_team_reset()
    assert lib.lora_call_threads(big, 0) == top and lib.lora_team_backoff() == 0.0


def test_the_team_call_that_ends_a_back_off_is_not_judged(fresh_policy):
    """After a back-off the team's threads have gone to sleep: the first team call wakes them and
    is not judged (judging it kept a process on one thread for good, 3.6x slower on an idle
    machine for a 4096 x 4096 rank-64 decode); the one after it is."""
    if lora.get_num_threads() < 2:
        pytest.skip("one thread: no team")
    big = 1 << 30
    lib.lora_team_report(1e-5, 1e-5)      # waking call
    lib.lora_team_report(1e-5, 1e-5)      # loses
    lib.lora_team_report(1e-5, 1e-5)      # loses again: back off for 10 ms (the minimum)
    assert 0.0 < lib.lora_team_backoff() <= 0.01
    while lib.lora_team_backoff() > 0.0:
        time.sleep(0.002)
    assert lib.lora_call_threads(big, 0) == lora.get_num_threads()  # the back-off has ended
    lib.lora_team_report(5e-3, 1e-3)      # a slow wake-up: not judged
    assert lib.lora_team_backoff() == 0.0 and _team_calls() == (4, 2)
    lib.lora_team_report(1e-3, 1e-3)      # judged: lost
    lib.lora_team_report(1e-3, 1e-3)      # and again: back off
    assert lib.lora_team_backoff() > 0.0 and _team_calls() == (6, 4)


def test_losses_that_wins_do_not_repay_back_off(fresh_policy):
    """Under load a lost team call waits a scheduler tick for its partner while a won one saves
    microseconds: wins in between do not clear what the losses cost, so a lose-win-lose run backs
    off (judging each call alone it never did, and the calls ran at 2.2x one thread's time)."""
    lib.lora_team_report(1e-5, 1e-5)      # waking call
    lib.lora_team_report(4e-3, 1e-5)      # lost a tick
    lib.lora_team_report(0.5e-5, 1e-5)    # paid, 5 us: the tick is still owed
    assert lib.lora_team_backoff() == 0.0
    lib.lora_team_report(4e-3, 1e-5)      # lost a tick again: back off
    assert lib.lora_team_backoff() > 0.5 and _team_calls() == (4, 2)


def test_the_back_off_pays_for_the_whole_probe(fresh_policy):
    """A probe's first team call (waking the team) can wait a tick under load: the back-off it
    buys is at least 100x every team call since the team last paid, that one included, so
    probing costs ~1 % of the time however the probe's time was spent."""
    lib.lora_team_report(4e-3, 1e-5)      # waking call, a tick: not judged, but paid for
    lib.lora_team_report(1.1e-5, 1e-5)    # lost by a little
    lib.lora_team_report(1.1e-5, 1e-5)    # and again: back off
    assert lib.lora_team_backoff() >= 0.4  # 100x the probe's 4.02 ms, not 100x the 11 us call
    lib.lora_team_reset()
    lib.lora_team_report(4e-3, 1e-5)      # a slow waking call followed by calls that pay
    for _ in range(3):
        lib.lora_team_report(0.6e-5, 1e-5)
    lib.lora_team_report(1.1e-5, 1e-5)    # then two small losses: 100x their 22 us < 10 ms
    lib.lora_team_report(1.1e-5, 1e-5)
    assert 0.0 < lib.lora_team_backoff() <= 0.01  # the paid-for wake-up is not billed again


def test_one_lost_team_call_among_winners_starts_no_back_off(fresh_policy):
    """An interrupt can slow one team call on an idle machine: a loss the next win repays
    starts nothing."""
    lib.lora_team_report(1e-3, 1e-3)      # waking call
    for _ in range(5):
        lib.lora_team_report(1e-3, 1e-3)  # lost
        lib.lora_team_report(0.5e-3, 1e-3)  # paid
    assert lib.lora_team_backoff() == 0.0 and _team_calls() == (11, 5)


def test_thread_policy_in_kernel_info():
    info = lora.kernel_info()
    assert isinstance(info["thread_policy"], str)
    with num_threads(1):
        assert lora.kernel_info()["thread_policy"].startswith("one thread")
    if info["openmp"] and TWO:
        lib.lora_team_reset()
        assert lora.kernel_info()["thread_policy"].startswith("adaptive: up to 2 threads")


def test_omp_wait_policy_is_left_to_the_user():
    """The library never sets OMP_WAIT_POLICY (GNU OpenMP reads it at start-up, so it stays the
    user's choice); one the user set is reported as theirs."""
    code = ("import os, lora; print(os.environ.get('OMP_WAIT_POLICY', '-')); "
            "print(lora.kernel_info()['thread_policy'])")
    env = subprocess_env()
    env.pop("OMP_WAIT_POLICY", None)
    p = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    first, policy = p.stdout.splitlines()
    assert first == "-" and "OMP_WAIT_POLICY" not in policy
    p = subprocess.run([PYTHON, "-c", code], env=subprocess_env(OMP_WAIT_POLICY="passive"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    first, policy = p.stdout.splitlines()
    assert first == "passive"
    if lora.kernel_info()["openmp"] and TWO:
        assert "OMP_WAIT_POLICY=passive (yours)" in policy


# ----------------------------------------------------------------------------------- fork

_FORK_SCRIPT = textwrap.dedent(r"""
    import os, signal, sys, threading, time
    import numpy as np
    import lora

    TIMEOUT = float(sys.argv[1])
    MODE = sys.argv[2]
    rng = np.random.default_rng(0)
    # big enough that every call opens an OpenMP team in the parent
    d = lora.LoraDelta(rng.standard_normal((16, 2053)), rng.standard_normal((2051, 16)))
    bank = lora.LoraBank([d, None, lora.LoraStack([d, d])])
    x = rng.standard_normal((9, 2053)).astype(np.float32)
    ids = rng.integers(0, 2051, size=9)
    aids = np.array([0, 2, -1, 1, 0, 2, 2, 0, -1])

    def work():
        return (d.add_batch_to(x, np.zeros((9, 2051), np.float32)),
                d.add_to(x[0], np.zeros(2051, np.float32)),
                d.add_rows_to(ids, np.zeros((9, 2053), np.float32)),
                bank.add_batch_to(x, np.zeros((9, 2051), np.float32), aids))

    def same(p, q):
        return all(np.array_equal(a, b) for a, b in zip(p, q))

    ref = work()   # the parent's OpenMP pool now exists
    assert lora.get_num_threads() >= 1

    busy_stop = threading.Event()
    def busy():    # MODE=during: another thread keeps OpenMP teams busy while we fork
        while not busy_stop.is_set():
            work()
    if MODE == "during":
        t = threading.Thread(target=busy)
        t.start()
        time.sleep(0.05)

    children = []
    for round_ in range(3):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ok = same(work(), ref) and same(work(), ref)
                # a grandchild, too
                gpid = os.fork()
                if gpid == 0:
                    os._exit(0 if same(work(), ref) else 1)
                _, st = os.waitpid(gpid, 0)
                code = 0 if ok and os.waitstatus_to_exitcode(st) == 0 else 1
            except BaseException as exc:
                print("child error:", repr(exc), flush=True)
                code = 2
            os._exit(code)
        children.append(pid)
        if not same(work(), ref):   # the parent's pool still works after fork
            print("parent result changed after fork", flush=True)
            sys.exit(4)

    busy_stop.set()
    if MODE == "during":
        t.join()
    deadline = time.monotonic() + TIMEOUT
    failed = 0
    for pid in children:
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(st)
                if code != 0:
                    print(f"child {pid} exited with {code}", flush=True)
                    failed += 1
                break
            if time.monotonic() > deadline:
                print(f"child {pid} hung: killed after {TIMEOUT} s", flush=True)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                failed += 1
                break
            time.sleep(0.01)
    print(f"forked {len(children)} children, {failed} failed; threads in parent "
          f"{lora.get_num_threads()}", flush=True)
    sys.exit(1 if failed else 0)
""")


@pytest.mark.parametrize("mode", ["after", "during"],
                         ids=["fork-after-omp-work", "fork-while-another-thread-runs-omp"])
def test_fork_after_openmp_work_child_finishes(mode, tmp_path):
    if not lora.kernel_info()["openmp"]:
        pytest.skip("built without OpenMP: nothing to stress")
    if mode == "during" and os.environ.get("LORA_UNDER_ASAN") == "1":
        # GCC 12's ASan allocator takes no lock around fork(): a child forked while another
        # thread is inside malloc inherits that size class's mutex held, and hangs at its first
        # allocation of that class (seen: in numpy's calloc, 2 runs in 12).  glibc's malloc,
        # which every other stage runs this test with, resets its locks in the child.
        pytest.skip("ASan's allocator is not fork-safe while another thread allocates")
    script = tmp_path / "fork_stress.py"
    script.write_text(_FORK_SCRIPT)
    timeout = 20.0
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(lora.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               PYTHONPATH=os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run([sys.executable, str(script), str(timeout), mode], env=env,
                              capture_output=True, text=True, timeout=timeout + 30)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the fork stress process hung past {timeout + 30} s: {exc.stdout!r}")
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout: {proc.stdout}\n"
                                  f"stderr: {proc.stderr[-3000:]}")


_TORCH_FORK_SCRIPT = textwrap.dedent(r"""
    import multiprocessing, os, signal, sys, time
    FIRST, WORK, HOW = sys.argv[1:4]
    if FIRST == "torch":   # which import loads the OpenMP runtime the two then share
        import torch
        import lora
    else:
        import lora
        import torch
    import numpy as np
    from lora._lora_cffi import ffi, lib

    rng = np.random.default_rng(0)
    d = lora.LoraDelta(rng.standard_normal((16, 2048)), rng.standard_normal((2048, 16)))
    x = rng.standard_normal((64, 2048)).astype(np.float32)
    ref = d.add_batch_to(x, np.zeros((64, 2048), np.float32))

    def torch_op():    # threaded in torch: a matmul and an element-wise op over many elements
        a = torch.randn(768, 768, generator=torch.Generator().manual_seed(0))
        return float((a @ a).sum()) + float(torch.relu(torch.randn(1 << 21)).sum())

    if "lora" in WORK:
        lib.lora_team_reset()
        for _ in range(4):
            d.add_batch_to(x, np.zeros((64, 2048), np.float32))
        calls, lost = ffi.new("int64_t *"), ffi.new("int64_t *")
        lib.lora_team_stats(calls, lost)
        if calls[0] < 1:
            print("the parent's lora calls opened no OpenMP team", flush=True)
            sys.exit(5)
    if "torch" in WORK:
        torch_op()

    def child():
        got = torch_op()
        out = d.add_batch_to(x, np.zeros((64, 2048), np.float32))
        tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 2
        return got, np.array_equal(out, ref), torch.get_num_threads(), tasks

    TIMEOUT = 30.0
    if HOW == "pool":   # multiprocessing's fork start method, as a worker pool uses it
        pool = multiprocessing.get_context("fork").Pool(1)
        res = pool.apply_async(child)
        try:
            got, same, threads, tasks = res.get(TIMEOUT)
        except multiprocessing.TimeoutError:
            print("the pool worker hung in a threaded torch op", flush=True)
            pool.terminate()
            sys.exit(3)
        pool.close()
        pool.join()
    else:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                got, same, threads, tasks = child()
                os.write(w, f"{same} {threads} {tasks}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        deadline = time.monotonic() + TIMEOUT
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                print("the forked child hung in a threaded torch op", flush=True)
                sys.exit(3)
            time.sleep(0.02)
        if os.waitstatus_to_exitcode(st) != 0:
            print(f"the child exited with {os.waitstatus_to_exitcode(st)}", flush=True)
            sys.exit(4)
        same, threads, tasks = os.read(r, 100).decode().split()
        same, threads, tasks = same == "True", int(threads), int(tasks)
    if not same:
        print("the child's lora call gave other bits", flush=True)
        sys.exit(6)
    if threads < 2 or tasks < 2:   # the child's torch op must have run on a team
        print(f"the child's torch op was not threaded ({threads} threads, {tasks} tasks)")
        sys.exit(7)
    torch_op()   # the parent's pools still work
    print("ok", flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork()")
@pytest.mark.parametrize("first", ["torch", "lora"], ids=["torch-imported-first",
                                                          "lora-imported-first"])
@pytest.mark.parametrize("work,how", [("lora", "fork"), ("torch", "fork"), ("lora+torch", "pool")])
def test_threaded_torch_op_in_a_child_forked_after_threaded_calls(first, work, how, tmp_path):
    """A child forked after threaded lora (or torch) calls runs a threaded torch op (and a lora
    call) instead of hanging: fork() releases the forking thread's OpenMP pool first.  Each run
    is a subprocess under a timeout, so a hang fails the test instead of hanging pytest."""
    pytest.importorskip("torch")
    if not (lora.kernel_info()["openmp"] and TWO):
        pytest.skip("needs an OpenMP build and two threads")
    assert lora.kernel_info()["fork_safe_openmp"]
    if work != "lora" and lora.kernel_info()["compiler"].startswith("clang"):
        # a clang build runs on LLVM's libomp, torch's wheel on its own libgomp: the handler
        # releases lora's runtime's pool, and a pool torch's own calls made is torch's
        pytest.skip("lora's OpenMP runtime (libomp) is not torch's (libgomp)")
    script = tmp_path / "torch_fork.py"
    script.write_text(_TORCH_FORK_SCRIPT)
    env = subprocess_env(OMP_NUM_THREADS=2)
    try:
        proc = subprocess.run([PYTHON, str(script), first, work, how], env=env,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the fork harness itself hung: {exc.stdout!r}")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr[-3000:]}")


@pytest.mark.parametrize("kind", ["delta", "stack", "bank", "bank-f16-out"])
def test_prefills_of_many_blocks_keep_each_positions_bits(kind, fresh_policy):
    """A prefill of many blocks with mixed storage dtypes and odd sizes (tails in every row tile
    and column strip), on one thread and on a team: every position has the bits of add_to on
    it alone (a block of one)."""
    rng = np.random.default_rng(11)
    n, rows, cols = 301, 515, 333  # 76 blocks, the last of one position
    x = rand(rng, (n, cols))
    odt = np.float16 if kind.endswith("f16-out") else np.float32
    members = [make_delta(rng, r, rows, cols, dt, scale=0.3 + 0.1 * i)
               for i, (r, dt) in enumerate(((96, "float32"), (40, "bfloat16"), (7, "float16")))]
    ids = rng.integers(-1, 3, n)
    if kind == "delta":
        apply_all = lambda o: members[0].add_batch_to(x, o)
        apply_one = lambda b, o: members[0].add_to(x[b], o)
    elif kind == "stack":
        stack = lora.LoraStack(members)
        apply_all = lambda o: stack.add_batch_to(x, o)
        apply_one = lambda b, o: stack.add_to(x[b], o)
    else:
        bank = lora.LoraBank(members)
        apply_all = lambda o: bank.add_batch_to(x, o, ids)
        apply_one = lambda b, o: bank.add_batch_to(x[b:b + 1], o[None], ids[b:b + 1])
    start = rand(rng, (n, rows)).astype(odt)
    with num_threads(1):
        one = apply_all(start.copy())
    team = apply_all(start.copy())
    assert_same_bits(team, one, "team vs one thread")
    alone = start.copy()
    for b in range(n):
        apply_one(b, alone[b])
    assert_same_bits(one, alone, "batch vs each position alone")
