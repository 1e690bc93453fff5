/*
 * bench.c - the benchmark's bandwidth probe: the active ISA's read kernel
 * over a buffer, split over threads, to measure each memory level's read
 * bandwidth for the roofline (benchmarks/).
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
