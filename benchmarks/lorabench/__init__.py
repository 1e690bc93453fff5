"""lorabench: the library against NumPy, PyTorch CPU and the machine's own limits.

``benchmarks/bench.py`` is the entry point; the package holds the parts:

* ``machine``   CPU, caches (sysfs, else getconf), memory, thread pools, read bandwidth per level
                (the extension's C read kernel ``lora_bench_read``), compute peak (its FMA kernel
                ``lora_bench_fma``, beside the nominal figure), and the
                CPU other processes take while we measure (``/proc/stat``, ``/proc/loadavg``);
* ``timing``    pre-bound calls in calibrated loops, rounds over the implementations, medians;
* ``workloads`` the rows, one module per family (decode/prefill/stack, gather, model sweep, bank,
                bf16 activations, edge, adapter-set step, merge), each with its bytes / flops
                model; the NumPy and PyTorch baselines written once (``baselines``); the runner
                and the roofline / speedup analysis (``runner``);
* ``startup``   ``python -c "import lora"`` and ``python -m lora info`` in fresh processes;
* ``peftmodel`` whole-model rows: a Llama-shaped PEFT model run by PEFT and by ``accelerate_peft``;
                (``workloads.moepeft``: the same for a Qwen3-MoE with LoRA on its experts);
* ``targets``   the speed targets as a table, and the one function that judges them;
* ``report``    header, table, targets, JSON document and plot;
* ``isacompare`` ``--isa-compare``: a few rows under every ISA path the CPU runs, and the CPU table
                row (``csrc/isa.c``) the medians suggest;
* ``cli``       the flags and the run.

What is measured
----------------
Every workload goes through the public Python API (``LoraDelta.add_to`` and friends), end to end,
and is compared in the same run, at the same thread count, with

* NumPy naive:  ``out += s * (B @ (A @ x))``; batches ``out += s * ((x @ A.T) @ B.T)``;
  token rows ``out += s * (B[ids] @ A)``; mixed batches: a loop over ``np.unique(ids)`` with
  fancy indexing (what PEFT's mixed-batch forward does, in NumPy);
* NumPy tuned:  preallocated buffers, ``np.matmul(..., out=)`` on pre-transposed factors, the scale
  applied to the rank-sized intermediate in place, ``np.add(out, z, out=out)``;
* PyTorch CPU (when importable, and not ``--no-torch``): ``torch.matmul(out=)`` then
  ``out.addmv_`` / ``out.addmm_(..., alpha=s)`` on ``torch.from_numpy`` views (no copies); for
  float16 / bfloat16 rows the adapters are stored in that dtype in torch as well; mixed batches:
  the per-token gather + einsum of vLLM's CPU LoRA path, and PEFT-style grouping in torch.

Half-precision rows (adapters stored as float16 / bfloat16, activations float32) are compared
with the float32 NumPy baselines of the same shape (a NumPy user has no fast half matmul) and
with our own float32 row (``vs f32``).

Outputs accumulate across calls (the values only grow; nothing is reset inside the timed loop).
Before timing, each workload's result is checked against float64 NumPy once.

Roofline
--------
The read bandwidth of each memory level is measured with ``lora_bench_read`` (OpenMP, same
thread count, best of N rounds over all levels, at start-up and again at the end, keeping the
better figure).  A workload's working set (= its bytes per call, which the timed loop re-reads
every call) lives in the smallest level that holds it.  The model sweep is sized from the
machine's last-level cache (its half-precision adapters >= 2x the LLC, see
``workloads.sweep.size_sweep``) so that it streams from DRAM; its roof is the read kernel on a buffer
as large as the sweep, and its DRAM target divides by the DRAM figure, both measured interleaved
with it.  The lower bound of a call's time is max(bytes / bandwidth(level), flops / peak), with
peak the float32 flops per second of independent FMA chains on the active ISA's vectors, every
thread (``lora_bench_fma``, measured in the same rounds as the bandwidths and kept the same
way); "% roof" is that bound over the measured median.  The nominal peak (threads x nominal GHz
x SIMD lanes x 2 (FMA) x 2 FMA ports) is printed beside it: it overstates a core that runs
512-bit FMAs on 256-bit units (Zen 4: half) or has one FMA port, and understates a boosting
clock.

Noise
-----
Every timed block, bandwidth round and start-up measurement records the CPU other processes
took meanwhile.  A row above ``machine.CpuMonitor.BUSY`` CPUs is marked ``!``, and a target that
reads it reports ``noisy`` (with what was seen) instead of PASS / MISS.  ``--wait-quiet S``
re-measures such blocks once the machine is idle.
"""
