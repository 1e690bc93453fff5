"""The long fuzz run of the adapter loaders (the bounded one is tests/test_fuzz_files.py in CI).

    python benchmarks/fuzz_long.py                      # 20 minutes, rounds of 5000 examples
    python benchmarks/fuzz_long.py --minutes 120 --examples 20000 --seed 7
    python benchmarks/fuzz_long.py --rounds 1 --examples 200     # a quick look

Each round runs ``tests/test_fuzz_files.py``'s two hypothesis tests (mutated PEFT safetensors
directories and mutated GGUF files, loaded in a worker subprocess with a timeout and an
address-space limit) with ``LORA_FUZZ_EXAMPLES`` examples each and its own hypothesis seed
(``--seed`` + round number, so a failing round can be replayed with ``pytest
tests/test_fuzz_files.py -k fuzz --hypothesis-seed=N``), then the fixed corpus.  Rounds repeat
until ``--minutes`` have passed or ``--rounds`` are done, and stop at the first failing round
(hypothesis has shrunk it by then; pytest's output shows the minimal mutation) unless
``--keep-going``.

At the end it prints what was tried: loads per format, and how each ended -- loaded, refused
with LoraFormatError, or the failures that must stay at 0: any other exception (by type: every
refusal must be a LoraFormatError), crashes (the worker died: a segfault, an abort, a sanitizer
report), hangs, MemoryError.
Run it against the sanitizer build by starting it inside the environment .ci/sanitize.sh sets
up (LD_PRELOAD of libasan, LORA_UNDER_ASAN=1, the instrumented extension on PYTHONPATH).
"""

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lorabench.machine import REPO, import_lora

ROOT = Path(REPO)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="stop starting rounds after this")
    ap.add_argument("--rounds", type=int, default=0, help="at most this many rounds (0: no cap)")
    ap.add_argument("--examples", type=int, default=5000, help="examples per test per round")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed of the first round")
    ap.add_argument("--keep-going", action="store_true",
                    help="run the next round after a failing one (failures are still counted)")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()

    lora = import_lora()
    info = lora.kernel_info()
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus; "
          f"python {platform.python_version()}; lora {info['version']} isa={info['isa']}")
    if not hasattr(lora, "load_peft"):
        print("lora.load_peft is not available on this branch: nothing to fuzz")
        return 2

    stats = Path(tempfile.mkdtemp(prefix="lora-fuzz-")) / "loads.jsonl"
    env = dict(os.environ, LORA_FUZZ_EXAMPLES=str(args.examples), LORA_FUZZ_STATS=str(stats))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.monotonic()
    rounds, status, failed_rounds = 0, 0, []
    while True:
        seed = args.seed + rounds
        t0 = time.monotonic()
        proc = subprocess.run(
            [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
             f"--hypothesis-seed={seed}", str(ROOT / "tests" / "test_fuzz_files.py")],
            cwd=ROOT, env=env, capture_output=True, text=True)
        rounds += 1
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        print(f"round {rounds} (hypothesis seed {seed}): {last} [{time.monotonic() - t0:.0f} s]",
              flush=True)
        if proc.returncode != 0:
            print(proc.stdout[-20000:])
            print(proc.stderr[-5000:])
            status = 1
            failed_rounds.append(seed)
            if not args.keep_going:
                break
        if args.rounds and rounds >= args.rounds:
            break
        if time.monotonic() - start > args.minutes * 60:
            break

    counts = collections.Counter()
    others = collections.Counter()
    if stats.exists():
        for line in stats.read_text().splitlines():
            r = json.loads(line)
            counts[(r["kind"], r["outcome"])] += 1
            if r["outcome"] == "other_error":
                others[(r["kind"], r["type"])] += 1
    total = sum(counts.values())
    print(f"\n{total} loads in {rounds} rounds, {time.monotonic() - start:.0f} s")
    for kind in ("peft", "gguf"):
        row = {o: counts[(kind, o)] for o in
               ("ok", "format_error", "other_error", "crash", "hang", "memory_error")}
        print(f"  {kind}: {sum(row.values())} inputs: loaded {row['ok']}, LoraFormatError "
              f"{row['format_error']}, other exception {row['other_error']}, "
              f"crash {row['crash']}, hang {row['hang']}, MemoryError {row['memory_error']}")
    for (kind, typ), n in sorted(others.items()):
        print(f"    {kind}: {n} x {typ}")
    bad = sum(counts[(k, o)] for k in ("peft", "gguf")
              for o in ("other_error", "crash", "hang", "memory_error"))
    print(f"other exceptions + crashes + hangs + MemoryErrors: {bad}")
    if failed_rounds:
        print(f"failing rounds (hypothesis seeds): {failed_rounds}")
    return 1 if status or bad else 0


if __name__ == "__main__":
    sys.exit(main())
