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

/* A delta's own packed factors (whole padded rows), read in the order its
 * decode call meets them: A (the project), then B^T (the accumulate), each
 * split over the team, which meets once in between; *bytes += what was read. */
static double read_delta_(const lora_delta *d, lora_read_fn read, int tid, int nt, int64_t *bytes) {
    const int64_t isz = (int64_t)lora_dtype_size(d->dtype);
    const int64_t na = d->rank * d->lda * isz / 4, nb = d->rank * d->ldb * isz / 4;
    int64_t lo, hi;
    if (tid == 0) *bytes += 4 * (na + nb);
    lora_split(na, tid, nt, 16, &lo, &hi);
    double total = read((const float *)d->a + lo, hi - lo);
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp barrier
    }
#endif
    lora_split(nb, tid, nt, 16, &lo, &hi);
    return total + read((const float *)d->bt + lo, hi - lo);
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
