"""The benchmark's report of PEFT rows (benchmarks/lorabench): a LoRA overhead below the floor
it is measured against is printed as noise, never as a negative cost."""

import sys
from pathlib import Path
from types import SimpleNamespace

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
    assert row.startswith('{"AuthenticAMD", 25, 17, 17, LORA_ISA_AVX2, 0, "<core name>", "bench.py --isa-compare 2026-01-01: '
                          'avx2 fastest on 4/4 rows, scalar 8.00x its time, avx512 1.25x its time')
    assert row.endswith("},") and "noisy" not in text
    # the widest path winning keeps the flags rule; a busy machine marks the suggestion noisy
    lines = isacompare.report_lines("CPU: test", kinfo, _isa_results({"scalar": 8e-5, "avx2": 1.5e-5, "avx512": 1e-5},
                                                                     busy=0.5), isas, "2026-01-01", "0.50 CPUs")
    assert ", FLAGS_, 0, " in lines[-1] and "noisy" in lines[-1] and "(noisy):" in lines[-2]
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
    import numpy as np

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
