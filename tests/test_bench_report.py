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
    impls = {"peft_merged": {"median_s": floor, "min_s": floor - 1e-3},
             "ours": {"median_s": ours, "min_s": ours - 1e-3},
             "peft_unmerged": {"median_s": peft, "min_s": peft - 1e-3}}
    result = {"layers": 4, "floor": "peft_merged", "impls": impls,
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

    ms = {"peft_merged": 10, "ours": 12, "ours_plain": 11.8, "ours_set_scale": 13, "peft_unmerged": 150,
          "peft_dora_cached": 13, "peft_plain": 14}
    impls = {k: {"median_s": v * 1e-3, "min_s": v * 1e-3} for k, v in ms.items()}
    result = {"layers": 8, "floor": "peft_merged", "impls": impls,
              "speedup": {k: v / ms["ours"] for k, v in ms.items() if k != "ours"}}
    row = SimpleNamespace(result=result, name=dorapeft.DECODE, group="peft", dtype="float32")
    notes = " ".join(report._peft_notes(row))
    assert "PEFT, DoRA norm cache on 3.00 (3.00) ms" in notes and "ours, set_scale + decode" in notes
    got = {t.what: targets.evaluate(t, [row], None, busy_limit=1.0)
           for t in targets.TARGETS if t.what.startswith(dorapeft.DECODE)}
    assert len(got) == 4 and all(v["status"] == "PASS" for v in got.values()), got
    assert got[f"{dorapeft.DECODE} f32: DoRA overhead, ours / our plain LoRA's"]["value"] == pytest.approx(2 / 1.8)
    assert got[f"{dorapeft.DECODE} f32: DoRA overhead, ours / PEFT's default DoRA's"]["value"] == pytest.approx(2 / 140)
