/*
 * internal.h - what the ISA choice, the team policy, delta storage, the
 * runners in apply.c, the merges and the benchmark helper share inside the extension
 * (not part of the C API, not seen by cffi).
 */
#ifndef LORA_INTERNAL_H
#define LORA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* isa.c: the kernel table of the ISA path in use */
const lora_kernel_table *lora_active_kernels(void);

/* team.c: whether this process is a child after fork() (a GNU OpenMP pool
 * does not survive it), and seconds on a monotonic clock (CLOCK_MONOTONIC,
 * else omp_get_wtime, else 0): the team policy's timer */
int lora_forked(void);
double lora_now(void);

/* delta.c: 64-byte aligned memory (posix_memalign / _aligned_malloc) */
void *lora_aligned_alloc(size_t bytes);
void lora_aligned_free(void *p);

/* [lo, hi) of n items for thread tid of nt, boundaries on multiples of `align` */
static inline void lora_split(int64_t n, int tid, int nt, int64_t align, int64_t *lo,
                              int64_t *hi) {
    const int64_t units = (n + align - 1) / align;
    const int64_t per = units / nt, extra = units % nt;
    const int64_t u0 = tid * per + (tid < extra ? tid : extra);
    const int64_t u1 = u0 + per + (tid < extra ? 1 : 0);
    *lo = u0 * align < n ? u0 * align : n;
    *hi = u1 * align < n ? u1 * align : n;
}

#endif /* LORA_INTERNAL_H */
