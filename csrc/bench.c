/*
 * bench.c - the benchmark's probes: the active ISA's read kernel over a
 * buffer, split over threads, to measure each memory level's read bandwidth
 * for the roofline (benchmarks/), and over deltas' own storage; and its FMA
 * kernel on every thread, the compute side of the roofline.
 */
#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

double lora_bench_read(const float *buf, int64_t n, int64_t reps, int nthreads) {
    double total = 0.0;
    const lora_read_fn read = lora_active_kernels()->read;
    if (nthreads < 1 || lora_forked()) nthreads = 1;
#ifdef _OPENMP
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
        {
            int64_t lo, hi;
            lora_split(n, omp_get_thread_num(), omp_get_num_threads(), 16, &lo, &hi);
            for (int64_t r = 0; r < reps; r++) total += read(buf + lo, hi - lo);
        }
        return total;
    }
#endif
    for (int64_t r = 0; r < reps; r++) total += read(buf, n);
    return total;
}

/* A delta's own packed factors (whole padded rows, a block format's scales
 * after its values), read in the order its decode call meets them: A (the
 * project), then B^T (the accumulate), each split over the team, which meets
 * once in between; *bytes += what was read. */
static double read_factor_(const lora_factor *f, int64_t rank, lora_read_fn read, int tid, int nt,
                           int64_t *bytes) {
    const int64_t nv = rank * f->ld * (int64_t)lora_format_value_size(f->fmt) / 4;
    const int64_t block = lora_format_block(f->fmt);
    const int64_t nd = block > 1 ? rank * f->ld / block * 2 / 4 : 0;
    int64_t lo, hi;
    if (tid == 0) *bytes += 4 * (nv + nd);
    lora_split(nv, tid, nt, 16, &lo, &hi);
    double total = read((const float *)f->v + lo, hi - lo);
    lora_split(nd, tid, nt, 16, &lo, &hi);
    if (nd) total += read((const float *)f->d + lo, hi - lo);
    return total;
}

static double read_delta_(const lora_delta *d, lora_read_fn read, int tid, int nt, int64_t *bytes) {
    double total = read_factor_(&d->a, d->rank, read, tid, nt, bytes);
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp barrier
    }
#endif
    return total + read_factor_(&d->bt, d->rank, read, tid, nt, bytes);
}

double lora_bench_read_deltas(const lora_delta *const *ds, int64_t n, int nthreads,
                              int64_t *bytes) {
    double total = 0.0;
    int64_t read_bytes = 0;
    const lora_read_fn read = lora_active_kernels()->read;
    if (nthreads < 1 || lora_forked()) nthreads = 1;
    for (int64_t i = 0; i < n; i++) {
        if (!ds[i]->owned) continue; /* a view of the caller's memory (PEFT's tensors) */
#ifdef _OPENMP
        if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
            total += read_delta_(ds[i], read, omp_get_thread_num(), omp_get_num_threads(),
                                 &read_bytes);
            continue;
        }
#endif
        total += read_delta_(ds[i], read, 0, 1, &read_bytes);
    }
    if (bytes) *bytes = read_bytes;
    return total;
}

double lora_bench_fma(int64_t n, int nthreads, int64_t *flops) {
    double total = 0.0;
    int64_t done = 0;
    const lora_peak_fn peak = lora_active_kernels()->peak;
    if (nthreads < 1 || lora_forked()) nthreads = 1;
    if (n < 0) n = 0;
#ifdef _OPENMP
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads) reduction(+ : total, done)
        {
            int64_t mine = 0;
            total += peak(n, &mine);
            done += mine;
        }
    } else
#endif
        total = peak(n, &done);
    if (flops) *flops = done;
    return total;
}
