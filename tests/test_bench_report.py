"""The benchmark's report (benchmarks/lorabench) on recorded samples: a LoRA overhead below the
floor it is measured against is printed as noise, never as a negative cost; samples a descheduled
thread stretched by whole scheduler ticks never make a ratio, and the marks sit next to the numbers
they qualify; the closing summary counts the rows; a baseline's formulations fold into the
fastest, named."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
if not (BENCH / "lorabench").is_dir():  # an installed-wheel run copies tests/ alone
    pytest.skip("the benchmarks are not beside these tests", allow_module_level=True)
sys.path.insert(0, str(BENCH))

from lorabench import report, targets  # noqa: E402


def peft_row(ours, peft, floor=10e-3):
    impls = {"peft_base": {"median_s": floor, "min_s": floor - 1e-3},
             "ours": {"median_s": ours, "min_s": ours - 1e-3},
             "peft_unmerged": {"median_s": peft, "min_s": peft - 1e-3}}
    result = {"layers": 4, "floor": "peft_base", "impls": impls,
              "speedup": {"peft_unmerged": peft / ours}}
    return SimpleNamespace(result=result)


def test_a_negative_overhead_is_flagged_as_noise():
    row = peft_row(ours=9.5e-3, peft=14e-3)  # ours measured 0.5 ms below the floor
    notes = " ".join(report._peft_notes(row))
    assert "ours -0.50 [below the floor: noise]" in notes
    assert "4.00 ms" in notes or "4.00 (" in notes  # PEFT's positive overhead is plain
    assert notes.count("noise") == 2  # the median and the minimum of ours
    _, detail, _ = targets.Overhead("peft_unmerged")([row], None)
    assert "ours -0.50 [below the floor: noise] ms" in detail
    plain = " ".join(report._peft_notes(peft_row(ours=11e-3, peft=14e-3)))
    assert "noise" not in plain and "ours 1.00 (1.00) ms" in plain


def test_the_dora_rows_render_and_feed_their_targets():
    from lorabench.workloads import dorapeft

    ms = {"peft_base": 10, "ours": 12, "ours_plain": 11.8, "ours_set_scale": 13, "peft_unmerged": 150,
          "peft_dora_cached": 13, "peft_plain": 14}
    impls = {k: {"median_s": v * 1e-3, "min_s": v * 1e-3} for k, v in ms.items()}
    result = {"layers": 8, "floor": "peft_base", "impls": impls,
              "speedup": {k: v / ms["ours"] for k, v in ms.items() if k != "ours"}}
    row = SimpleNamespace(result=result, name=dorapeft.DECODE, group="peft", dtype="float32")
    notes = " ".join(report._peft_notes(row))
    assert "PEFT, DoRA norm cache on 3.00 (3.00) ms" in notes and "ours, set_scale + decode" in notes
    got = {t.what: targets.evaluate(t, [row], None, busy_limit=1.0)
           for t in targets.TARGETS if t.what.startswith(dorapeft.DECODE)}
    assert len(got) == 4 and all(v["status"] == "PASS" for v in got.values()), got
    assert got[f"{dorapeft.DECODE} f32: DoRA overhead, ours / our plain LoRA's"]["value"] == pytest.approx(2 / 1.8)
    assert got[f"{dorapeft.DECODE} f32: DoRA overhead, ours / PEFT's default DoRA's"]["value"] == pytest.approx(2 / 140)


def _isa_results(medians, busy=0.0):
    """--isa-compare results: every ROWS row with these per-path medians (seconds)."""
    from lorabench import isacompare

    paths = {isa: {"median_s": m, "min_s": 0.9 * m, "max_s": 1.2 * m, "n": 25} for isa, m in medians.items()}
    return {f"{name} {isacompare.DT[dt]}": {"paths": paths, "others_cpu": busy, "check": {}}
            for name, dt in isacompare.ROWS}


ZEN4 = {"vendor": "AuthenticAMD", "family": 25, "model": 17, "stepping": 1, "name": None}


def test_isa_compare_suggests_the_narrower_path_where_it_wins():
    from lorabench import isacompare

    isas = ["scalar", "avx2", "avx512"]
    kinfo = {"version": "0", "isa": "avx512", "threads": 2, "isa_reason": "flags: ...", "cpu": ZEN4}
    lines = isacompare.report_lines("CPU: test", kinfo, _isa_results({"scalar": 8e-5, "avx2": 1e-5, "avx512": 1.25e-5}),
                                    isas, "2026-01-01", "0.00 CPUs")
    text = "\n".join(lines)
    assert "scalar/avx512" in text and "avx2/avx512" in text and "0.80x" in text
    row = lines[-1].strip()
    assert row.startswith('{"AuthenticAMD", 25, 17, 17, LORA_ISA_AVX2, 0, LORA_Q8_0_WIDEN_SHUFFLE, "<core name>", '
                          '"bench.py --isa-compare 2026-01-01: '
                          'avx2 fastest on 4/4 rows, scalar 8.00x its time, avx512 1.25x its time')
    assert row.endswith("},") and "noisy" not in text
    # the widest path winning keeps the flags rule; a busy machine marks the suggestion noisy
    lines = isacompare.report_lines("CPU: test", kinfo, _isa_results({"scalar": 8e-5, "avx2": 1.5e-5, "avx512": 1e-5},
                                                                     busy=0.5), isas, "2026-01-01", "0.50 CPUs")
    assert ", FLAGS_, 0, LORA_Q8_0_WIDEN_SHUFFLE, " in lines[-1] and "noisy" in lines[-1] and "(noisy):" in lines[-2]
    assert "! others 0.50 CPU" in "\n".join(lines)


def test_isa_compare_without_cpuid_suggests_no_row():
    from lorabench import isacompare

    kinfo = {"version": "0", "isa": "neon", "threads": 2, "isa_reason": "flags: ...",
             "cpu": dict.fromkeys(ZEN4)}
    lines = isacompare.report_lines("CPU: test", kinfo, _isa_results({"scalar": 4e-5, "neon": 1e-5}),
                                    ["scalar", "neon"], "2026-01-01", "-")
    assert "scalar/neon" in "\n".join(lines) and "no CPU table on this architecture" in lines[-1]


def test_team_compare_suggests_the_lowest_floor_every_row_above_pays():
    from lorabench import teamcompare

    zen4 = [(1 << 16, 1.04), (1 << 17, 0.80), (1 << 17, 0.85), (1 << 17, 0.68)]
    assert teamcompare.suggest(zen4) == 17
    assert teamcompare.suggest([(1 << 16, 0.85), (1 << 17, 0.7)]) == 16
    # one losing row at 2^17 keeps the default; so do rows that never pay
    assert teamcompare.suggest([(1 << 16, 1.2), (1 << 17, 0.8), (1 << 17, 0.95)]) == 0
    assert teamcompare.suggest([(1 << 17, 1.1)]) == 0 and teamcompare.suggest([]) == 0
    assert teamcompare.nbytes(4096, 4096, 16, "float32") == (544 << 10)


def test_team_compare_runs_and_restores_the_floor(capsys):
    """A short --team-compare: a row per L2-sized decode, the suggestion line, and this core's
    own floor and thread count back afterwards."""
    import argparse

    import lora
    from lora._lora_cffi import lib
    from lorabench import teamcompare

    floor, threads = lib.lora_team_min_work(), lora.get_num_threads()
    args = argparse.Namespace(threads=None, min_sample_ms=0.05, samples=1, rounds=1, settle_ms=0,
                              wait_quiet=None, no_progress=True)
    assert teamcompare.run(args) == 0
    text = capsys.readouterr().out
    if lora.kernel_info()["openmp"] and threads > 1:
        assert "decode 4096x4096 r16 float32" in text or lib.lora_team_l2_bytes() < 544 << 10
        assert "suggested team_floor_log2 for this core's csrc/isa.c row (the rows above): " in text
        assert "cold sweep float32" in text and "cold sweep bfloat16" in text
    else:
        assert "nothing to compare" in text
    assert lib.lora_team_min_work() == floor and lora.get_num_threads() == threads


def test_build_ab_runs_a_build_against_itself():
    """benchmarks/build_ab.py (two builds, call against call) cannot rot: its --quick rows, with
    this very build as the other one, run and report equal bits."""
    import os
    import subprocess

    import lora
    from conftest import PYTHON, subprocess_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(lora.__file__)))
    done = subprocess.run([PYTHON, str(BENCH / "build_ab.py"), "--other", root, "--quick"],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stdout.splitlines() if "new/other" in ln]
    assert len(lines) == 4 and all("bits equal" in ln for ln in lines), done.stdout
    assert "DRAM read alongside" in done.stdout and "storage read delta by delta" in done.stdout


def test_the_deltas_reader_reads_each_stored_factor_once():
    """The sweep's reference read of its deltas' own storage (``lora_bench_read_deltas``) covers
    every stored byte of A and B^T once at 1 and 2 threads, and skips views of a caller's
    memory (it must not read PEFT's tensors as if they were packed factors)."""

    import lora
    from lora._lora_cffi import ffi, lib

    rng = np.random.default_rng(3)
    shapes = ((7, 100, 33), (16, 4096, 256), (1, 5, 3))
    pairs = [(rng.integers(-4, 5, (r, c)).astype(np.float32),
              rng.integers(-4, 5, (rows, r)).astype(np.float32)) for r, rows, c in shapes]
    deltas = [lora.LoraDelta(a, b) for a, b in pairs]
    ptrs = ffi.new("lora_delta *[]", [d._ptr for d in deltas])
    nbytes = ffi.new("int64_t *")
    want = sum(float(a.sum()) + float(b.sum()) for a, b in pairs)  # small integers: exact sums
    for threads in (1, 2):
        assert lib.lora_bench_read_deltas(ptrs, len(deltas), threads, nbytes) == want
        least = sum(4 * r * (rows + c) for r, rows, c in shapes)  # rows padded to whole lines
        assert least <= nbytes[0] <= least + sum(2 * r * 64 * 2 for r, _, _ in shapes)
    lib.lora_bench_read_deltas(ptrs, len(deltas), 2, ffi.NULL)  # no byte count asked
    a, b = pairs[0]
    at = np.ascontiguousarray(a.T)  # A^T [cols, rank]: a view, held by row
    bt = np.ascontiguousarray(b.T)  # B^T [rank, rows]
    wide = np.zeros((7, 40), np.float32)  # A [rank, cols] in rows of 40 (PEFT's experts' layout)
    wide[:, :33] = a
    views = [lora.LoraDelta.view((at.ctypes.data, 7), (b.ctypes.data, 7), dtype="float32",
                                 rank=7, rows=100, cols=33, a_by_row=True, b_by_row=True,
                                 scale=1.0, keep=(at, b)),
             lora.LoraDelta.view((wide.ctypes.data, 40), (bt.ctypes.data, 100), dtype="float32",
                                 rank=7, rows=100, cols=33, scale=1.0, keep=(wide, bt))]
    for view in views:
        one = ffi.new("lora_delta *[]", [view._ptr])
        assert lib.lora_bench_read_deltas(one, 1, 2, nbytes) == 0.0 and nbytes[0] == 0


def test_the_compute_probe_counts_its_flops_and_converges():
    """The roofline's compute peak (``lora_bench_fma``): every chain reaches exactly 1, so the
    checksum is the lane count of the active ISA's chains times the threads, and the flops it
    reports are two per lane and step on every thread; a forked or odd thread count runs one."""
    import lora
    from lora._lora_cffi import ffi, lib

    flops = ffi.new("int64_t *")
    assert lib.lora_bench_fma(0, 1, flops) != lib.lora_bench_fma(10_000, 1, ffi.NULL)  # starts apart
    one = lib.lora_bench_fma(100_000, 1, flops)
    per_thread = flops[0]
    lanes = one  # chains x lanes, each exactly 1.0 after ~30 steps of a <- a / 2 + 1 / 2
    assert lanes == round(lanes) and lanes >= 32 and per_thread == 100_000 * 2 * lanes
    for threads in (2, 0):
        got = lib.lora_bench_fma(100_000, threads, flops)
        want = max(threads, 1) if lora.kernel_info()["openmp"] else 1
        assert got == want * lanes and flops[0] == want * per_thread


def test_the_report_prints_the_measured_peak_beside_the_nominal_one():
    meta = {"threads": 2, "cpu": {"mhz": 2600.0}, "lora": {"isa": "avx512"}, "bw_trials": 6,
            "peak_flops_nominal": 332.8e9, "peak_flops": 224.0e9, "peak_measured": True}
    line = report._peak_line(meta)
    assert line.startswith("compute peak (C kernel lora_bench_fma, 2 threads") and "224 GFLOP/s" in line
    assert "0.67x the nominal 2 threads x 2.60 GHz x 64 flop/cycle" in line and "333 GFLOP/s" in line
    meta.update(peak_flops=332.8e9, peak_measured=False)
    assert report._peak_line(meta).startswith("compute peak (nominal; the measurement failed)")


# ---------------------------------------------------------------- descheduled samples

TICK = 0.004
CACHES = {"L1d": 48 << 10, "L2": 2 << 20, "L3": 32 << 20}


def _row(name, samples, k=None, busy=0.0, dtype="float32", group="decode"):
    """A finished row from recorded per-call samples {impl: [seconds]} (k calls per sample: one
    sample of at least 1 ms, as the timing calibrates it), analysed as a run analyses it."""
    from lorabench.timing import summarize
    from lorabench.workloads import runner

    impls = {}
    for impl, v in samples.items():
        kk = k or max(1, round(1e-3 / min(v)))
        impls[impl] = {**summarize(v, kk), "calls_per_sample": kk}
    res = {"bytes": 544 << 10, "flops": 2 * 16 * 8192, "others_cpu": busy, "torch_used": True}
    res["impls"], res["candidates"] = runner.fold_candidates(impls)
    w = SimpleNamespace(name=name, group=group, dtype=dtype, key="", result=res)
    runner.analyse(w, res, None, None, 2, CACHES, {})
    return w


# what a busy 2-vCPU run recorded (bench.py --quick while two other processes kept both cores
# busy): NumPy's two BLAS threads waited a tick for a CPU on most calls, so its samples (one call
# each: the calibration's one call was already stretched) sit on whole ticks past its 9.5 us
TICKED = [4.0093e-3, 4.0101e-3, 8.0102e-3, 9.5e-6, 4.0089e-3, 12.0110e-3]
CLEAN = [5.9e-6, 6.0e-6, 5.95e-6, 6.1e-6, 5.9e-6]


def test_tick_quantized_samples_are_set_apart_and_counted():
    from lorabench.timing import descheduled, summarize

    flags, quantized = descheduled(TICKED, 1, 9.5e-6, TICK)
    assert flags == [True, True, True, False, True, True] and quantized == 5
    s = summarize(TICKED, 1)
    assert s["descheduled"] == 5 and s["tick_quantized"] == 5 and not s["clean"]
    assert s["all_median_s"] > 4e-3  # what the old report called the median
    # a few stretched samples among many clean ones: the median is the clean samples'
    mixed = [9.5e-6, 9.6e-6, 4.0095e-3, 9.4e-6, 9.7e-6, 8.0096e-3]
    s = summarize(mixed, 1)
    assert s["clean"] and s["descheduled"] == 2 and s["median_s"] == pytest.approx(9.55e-6)
    # a slow sample that is not far past the floor is the code's own spread, not a tick; so is
    # a block of calls each 2.5x slower on their own (the excess a fraction of a tick away from
    # a whole number); a block 3 ticks past the floor is descheduling wherever it falls
    assert not any(descheduled([9.5e-6, 11e-6, 14e-6], 100, 9.5e-6, TICK)[0])
    assert descheduled([11.4e-6, 37.9e-6, 11.4e-6 + 3.4 * TICK / 90], 90, 11.4e-6, TICK) == ([False, False, True], 0)
    # many calls a sample: a tick spread over k calls still shows as the block's excess
    k = 100
    per_call = [10e-6, 10e-6 + TICK / k, 10.2e-6, 10e-6 + 2 * TICK / k]
    assert descheduled(per_call, k, 10e-6, TICK) == ([False, True, False, True], 2)


def test_no_ratio_when_every_sample_sits_on_the_ticks_grid():
    """Recorded in a --quick run with other processes on both CPUs: NumPy's two BLAS threads
    waited for a CPU on every call, so even the fastest of its samples was the scheduler's
    (8, 8 and 10 ticks), and its one-thread naive form ran the same prefill in 0.25 ms.  The old
    report printed 406x; no ratio may come from them."""
    w = _row("prefill b32 4096x4096 r16", {
        "ours": [77.9e-6, 76.6e-6, 86.7e-6], "numpy_naive": [251.0e-6, 233.1e-6, 254.2e-6],
        "numpy_tuned:views": [31.994227e-3, 31.977592e-3, 39.974325e-3],
        "numpy_tuned:B^T copied": [32.167079e-3, 32.01e-3, 36.02e-3]}, group="prefill")
    r = w.result
    assert r["impls"]["numpy_tuned"]["descheduled"] == 3 and not r["impls"]["numpy_tuned"]["clean"]
    assert r["ratio_marks"].get("numpy_tuned") == "ticks" and "numpy_naive" not in r["ratio_marks"]
    line = report.table_lines([w])[2]
    assert "ticks" in line and "406" not in line and "3.22x" in line
    # a call that genuinely lasts about 8 ms, its samples spread off the grid, keeps its ratio
    from lorabench.timing import summarize
    assert summarize([8.3e-3, 7.7e-3, 8.9e-3], 1)["clean"]


def test_samples_spent_waiting_for_a_cpu_are_set_apart():
    """Recorded in a --quick run under a load average of 7: torch's two threads took 35-49 ms a
    call for a 10 us prefill, every call (no faster one to compare with, no tick grid), while
    the run queue held its threads for nearly all of it.  Without the wait the report printed
    8847x; a sample whose own threads mostly ran keeps its place however slow it is."""
    from lorabench.timing import descheduled, run_queue_wait, summarize

    torch_ms = [35.33e-3, 43.98e-3, 48.75e-3]
    assert descheduled(torch_ms, 1, 35.33e-3)[0] == [False, False, False]  # the times alone
    assert descheduled(torch_ms, 1, 35.33e-3, waited=[0.95, 1.4, 0.92])[0] == [True, True, True]
    s = summarize(torch_ms, 1, waited=[0.95, 1.4, 0.92])
    assert not s["clean"] and s["descheduled"] == 3
    # waiting a quarter of a sample counts only where the sample is also slow against the floor
    assert descheduled([10e-6, 16e-6, 10.5e-6], 100, 10e-6, waited=[0.3, 0.3, 0.3])[0] == [False, True, False]
    # summarize keeps each wait with its own sample when it sorts them
    assert summarize([16e-6, 10e-6, 10.5e-6], 100, waited=[0.3, 0.95, 0.0])["descheduled"] == 2
    if Path("/proc/self/task").is_dir():
        assert run_queue_wait() >= 0.0


def test_no_ratio_from_tick_dominated_samples_and_the_mark_sits_on_the_number():
    w = _row("decode 4096x4096 r16", {"ours": CLEAN, "numpy_naive": TICKED,
                                      "numpy_tuned:views": [13.6e-6] * 5, "numpy_tuned:transposed": [9.5e-6] * 5,
                                      "torch": [11e-6, 11e-6, 11e-6, 4.011e-3, 11.1e-6]})
    r = w.result
    assert r["ratio_marks"] == {"numpy_naive": "ticks", "torch": "~"}
    assert r["impls"]["numpy_tuned"]["how"] == "transposed" and r["speedup"]["numpy_tuned"] == pytest.approx(9.5 / 5.95)
    assert r["speedup"]["torch"] == pytest.approx(11.0 / 5.95)  # the stretched sample is not in it
    head, _, line = report.table_lines([w])
    cells = line.split()
    assert "ticks" in cells and not any(c.endswith("x") and float(c[:-1]) > 100 for c in cells if c[:-1].replace(".", "").isdigit())
    assert "1.60x" in cells and "1.85x~" in cells
    # the marks are in their columns, before the long "other" column
    assert line.index("ticks") < head.index("other") and line.index("1.85x~") < head.index("other")
    assert "tuned: transposed" in line
    busy = _row("decode 4096x4096 r16", {"ours": CLEAN, "numpy_tuned:views": [9.5e-6] * 5}, busy=1.9)
    line = report.table_lines([busy])[2]
    assert "5.95 µs!" in line and "1.60x!" in line and "others used" not in line
    # the target reading a "ticks" ratio is noisy, never PASS / MISS
    t = targets.Target("naive", targets.Rows("decode"), targets.Speedup("numpy_naive"), ">=", 2.0)
    got = targets.evaluate(t, [w], None, busy_limit=1.0)
    assert got["status"] == "noisy" and got["value"] is None and "descheduled" in got["detail"]
    t = targets.Target("tuned", targets.Rows("decode"), targets.Speedup("numpy_tuned"), ">=", 2.0)
    got = targets.evaluate(t, [w], None, busy_limit=1.0)
    assert got["status"] == "MISS" and "transposed" in got["detail"]


def test_the_closing_summary_counts_rows_and_says_where_and_how_long():
    rows = [_row("decode 4096x4096 r16", {"ours": CLEAN, "numpy_naive": TICKED, "numpy_tuned:a": [12e-6] * 5,
                                          "torch": [3e-6] * 5}),
            _row("prefill b8 4096x4096 r16", {"ours": [20e-6] * 5, "numpy_tuned:a": [40e-6] * 5,
                                              "torch": [30e-6] * 5}, busy=0.9),
            _row("gather n1 32000x4096 r16", {"ours": [2.6e-6] * 5, "numpy_tuned:a": [5.5e-6] * 5,
                                              "numpy_tuned:b": [6.2e-6] * 5, "torch": [5.4e-6] * 5}, group="gather")]
    meta = {"elapsed_s": 297.4, "quick": True, "threads": 2, "cpu": {"model": "AMD EPYC 9R14"},
            "load": {"loadavg_start": [2.1, 1, 1], "loadavg_end": [3.0, 2, 1], "others_cpu_run": 1.4}}
    text = "\n".join(report.summary_lines(rows, meta))
    # NumPy: 12/5.95, 2.0, 5.5/2.6 (naive's "ticks" ratio left out); torch: 3/5.95, 1.5, 5.4/2.6
    g_np = (12 / 5.95 * 2.0 * 5.5 / 2.6) ** (1 / 3)
    g_t = (3 / 5.95 * 1.5 * 5.4 / 2.6) ** (1 / 3)
    assert f"NumPy formulation measured: lora faster on 3 of 3 rows; geometric mean {g_np:.2f}x" in text
    assert f"PyTorch formulation measured: lora faster on 2 of 3 rows; geometric mean {g_t:.2f}x" in text
    assert "lowest 0.50x: decode 4096x4096 r16 f32" in text
    assert "noisy rows: 2 of 3 timed rows: 1 measured while other processes used > 0.15 CPUs (!), " \
           "1 with descheduled samples set apart (~); 1 ratio(s) not computed (ticks): " \
           "decode 4096x4096 r16 f32 vs numpy_naive" in text
    assert "this run: 297 s (--quick) on AMD EPYC 9R14, 2 threads; load average 2.10 at start, 3.00 at end" in text
    baselines = "\n".join(report.baseline_lines(rows))
    assert "NumPy tuned 5.50 µs" in baselines and "[a; b 6.20 µs]" in baselines


def test_a_one_call_calibration_stretched_by_a_tick_does_not_set_the_loop_length():
    """The loop length comes from the fastest of a few single calls: one call that lost the CPU
    (4 ms) must not make every sample a single call."""
    from lorabench.timing import Impl, TimingConfig, calibrate

    times = iter([10e-6, 4e-3] + [10e-6] * 200)  # first touch, then one call descheduled

    def call():
        import time as _t
        _t.sleep(0)  # its time comes from `times`

    impl = Impl(call)
    real = Impl.run

    def fake(self, k):
        t = sum(next(times, 10e-6) for _ in range(k))
        self.best = min(self.best, t / k)
        return t
    Impl.run = fake
    try:
        calibrate(impl, TimingConfig(min_sample_s=1e-3, samples=3, rounds=1, impl_budget_s=0.1, settle_s=0))
    finally:
        Impl.run = real
    assert impl.k >= 90 and impl.best == 10e-6


@pytest.mark.parametrize("batch", [None, 5])
def test_every_baseline_formulation_computes_the_lora_term(batch):
    """Each formulation a tuned baseline is timed in (NumPy's and PyTorch's, per delta and
    concatenated) adds s B (A x) into its out: a fast wrong baseline would flatter nobody."""
    from lorabench.workloads import baselines, core

    rng = np.random.default_rng(5)
    terms = [(*core.pair(rng, 33, 47, r), s) for r, s in ((4, 2.0), (7, 0.5))]
    x = core.rand(rng, (47,) if batch is None else (batch, 47), 1.0)
    want = sum(core.lora_ref(a, b, s, x) for a, b, s in terms)
    oshape = want.shape
    for build in (lambda o: baselines.numpy_tuned(baselines.calls(terms, x, o)),
                  lambda o: baselines.numpy_concat(terms, x, o)):
        out = np.zeros(oshape, np.float32)
        impls = build(out)
        assert len(impls) == 3
        for impl in impls.values():
            impl.fn(*impl.args)
        np.testing.assert_allclose(out, len(impls) * want, rtol=1e-5, atol=1e-6)
    torch = pytest.importorskip("torch")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        for build in (lambda o: baselines.torch_baseline(torch, baselines.calls(terms, torch.from_numpy(x), o), dtype),
                      lambda o: baselines.torch_concat(torch, terms, torch.from_numpy(x), o, dtype)):
            out = torch.zeros(oshape)
            impls = build(out)
            assert sorted(k.split(":")[1] for k in impls) == ["transposed copies", "views"]
            for impl in impls.values():
                impl.fn(*impl.args)
            np.testing.assert_allclose(out.numpy(), 2 * want, rtol=tol, atol=tol * np.abs(want).max())


def test_the_peft_example_never_prints_a_negative_lora_cost():
    """examples/peft_generate.py: a run faster than the base model it contains is noise, said so."""
    import importlib.util

    pytest.importorskip("peft")
    path = Path(__file__).resolve().parent.parent / "examples" / "peft_generate.py"
    spec = importlib.util.spec_from_file_location("peft_generate", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.lora_cost(6.13, 5.40, 32) == "LoRA  22.81 ms/step"
    text = example.lora_cost(5.40, 21.14, 32)  # the 491.72 ms/step "saving" of a busy machine
    assert "-" not in text and "491.88 ms/step below the base model's time (noise, not a saving)" in text


def test_the_set_step_is_sized_past_twice_the_last_level_cache():
    from lorabench.workloads import size_set_step
    from lorabench.workloads.setstep import QUICK_SET_LAYERS
    from lorabench.workloads.sweep import LLAMA2_7B_LAYERS

    # a 32 MiB L3: the model's 32 layers already read several times the cache
    layers, info = size_set_step(32 << 20, 64 << 30)
    assert layers == LLAMA2_7B_LAYERS and info["capped_by"] is None and info["q8_0_over_llc"] >= 2
    # a VM reporting a 480 MiB L3: more layers, until one q8_0 step reads twice the cache
    layers, info = size_set_step(480 << 20, 64 << 30)
    assert layers > LLAMA2_7B_LAYERS and 2 <= info["q8_0_over_llc"] < 2.1
    # too little memory: capped, and the report says by what
    layers, info = size_set_step(480 << 20, 4 << 30)
    assert info["capped_by"] == "memory" and layers < info["layers_wanted"]
    assert size_set_step(480 << 20, 64 << 30, quick=True)[0] == QUICK_SET_LAYERS


def test_the_set_step_and_the_sweep_say_what_their_arithmetic_takes_from_cache():
    """The `_cached` reference (the same calls on one layer's adapters): its share of the row's
    time and, for q8_0, its speed against bfloat16's from cache, in the target's detail."""
    from lorabench.workloads import runner

    def row(dtype, ours_ms, cached_ms):
        impls = {"ours": {"median_s": ours_ms * 1e-3, "min_s": ours_ms * 1e-3},
                 "_cached": {"median_s": cached_ms * 1e-3, "min_s": cached_ms * 1e-3}}
        return SimpleNamespace(result={"impls": impls, "bytes": 600 << 20, "flops": 1},
                               key="setstep", dtype=dtype, name="adapter-set step", group="setstep")

    bf16, q8 = row("bfloat16", 21.0, 9.0), row("q8_0", 18.0, 16.0)
    by_key = {("setstep", "bfloat16"): bf16}
    wl = SimpleNamespace(key="setstep", dtype="q8_0")
    caches = {"L1d": 32 << 10, "L2": 1 << 20, "L3": 32 << 20}
    runner.analyse(SimpleNamespace(key="setstep", dtype="bfloat16"), bf16.result, None, None, 2, caches, by_key)
    runner.analyse(wl, q8.result, None, None, 2, caches, by_key)
    assert q8.result["cached_share"] == pytest.approx(16 / 18)
    assert q8.result["cached_speedup_bf16"] == pytest.approx(9 / 16)
    metric = targets.WithCached(targets.Speedup("ours_bf16"))
    value, detail, _ = metric([q8], {"llc_bytes": 32 << 20})
    assert value == pytest.approx(21 / 18)
    assert "from cache: 16.00 ms = 0.89 of its time, 0.56x bf16's from cache" in detail
    # the ceiling of reading ahead: bf16's 21 ms over q8_0's 16 ms of arithmetic from cache
    assert "this value would be at most 1.31" in detail
    # the same ceiling on a share of the DRAM read: 600 MiB in 16 ms against a 50 GB/s read
    q8.result["gb_per_s"] = (600 << 20) / 18e-3 / 1e9
    run = {"llc_bytes": 32 << 20, "bw": {"DRAM": {"bytes_per_s": 50e9}}}
    dram = targets.WithCached(targets.DramShare())
    share, detail, _ = dram([q8], run)
    assert share == pytest.approx((600 << 20) / 18e-3 / 50e9)
    assert f"at most {(600 << 20) / 16e-3 / 50e9:.2f}" in detail
    # a ceiling past the DRAM read itself is not one: the arithmetic does not bound that row
    q8.result["gb_per_s"] *= 2
    assert "could reach 1: the arithmetic does not bound it" in dram([q8], run)[1]
    # a reference as slow as the row (noise), or of no time, gives no ceiling and no error
    for bad in (1.2, 0.0):
        q8.result["cached_share"] = bad
        _, detail, _ = metric([q8], {"llc_bytes": 32 << 20})
        assert f"no ceiling (the reference took {bad:.2f} of the row's time)" in detail and "at most" not in detail
    q8.result["cached_share"] = 16 / 18
    # a row that was not judged keeps its own reason alone
    lone = row("q8_0", 18.0, 16.0)
    runner.analyse(wl, lone.result, None, None, 2, caches, {})
    assert "cached_speedup_bf16" not in lone.result
    assert metric([lone], {"llc_bytes": 32 << 20})[:2] == (None, "")
    # a reference whose working set would not stay in the last-level cache is not shown as one
    q8.result["cached_working_set_bytes"] = 20 << 20
    _, big, _ = metric([q8], {"llc_bytes": 32 << 20})
    assert "would not stay in cache here" in big and "0.89 of its time" not in big


@pytest.mark.parametrize("name, args, expect", [
    ("q8_0_widen.c", ["64"], "every q8_0 way gives the float32 bits"),
    ("q8_0_readahead.c", ["1"], "cold hides"),
])
def test_the_c_benchmarks_build_and_run(name, args, expect, tmp_path):
    """The standalone C benchmarks docs/performance.md quotes cannot rot: each builds with the
    command its header gives (the widen one also with -mavx512vbmi, its vpermt2b way, where the
    CPU has VBMI), and where the CPU has AVX-512 a tiny run finishes (q8_0_widen.c first checks
    that every q8_0 way gives the float32 loop's bits, and exits 1 if one does not)."""
    import platform
    import shutil
    import subprocess

    from lora._runtime import available_isas

    if not sys.platform.startswith("linux") or platform.machine() != "x86_64" or not shutil.which("gcc"):
        pytest.skip("x86-64 Linux with gcc only")
    try:
        with open("/proc/cpuinfo") as f:
            vbmi = " avx512vbmi " in f.read().replace("\n", " ")
    except OSError:
        vbmi = False
    flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"]
    builds = [flags] + ([flags + ["-mavx512vbmi"]] if vbmi and name == "q8_0_widen.c" else [])
    exes = []
    for n, build in enumerate(builds):
        exe = tmp_path / f"{name[:-2]}{n}"
        built = subprocess.run(["gcc", *build, "-Wall", "-o", str(exe), str(BENCH / name), "-lm"],
                               capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr
        exes.append(exe)
    if "avx512" not in available_isas():
        pytest.skip("built; no AVX-512 here to run them")
    for exe in exes:
        done = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert expect in done.stdout
    if len(exes) == 2:
        assert "perm2" in done.stdout
