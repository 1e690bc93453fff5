/*
 * delta.c - a delta's packed storage: aligned allocation, packing of lora_a
 * and lora_b^T into padded rows (layout in kernels.h), and export back.
 */
#include <stdlib.h>
#include <string.h>
#if defined(_WIN32)
#include <malloc.h>
#endif

#include "internal.h"

void *lora_aligned_alloc(size_t bytes) {
    if (bytes == 0) bytes = LORA_ALIGN;
#if defined(_WIN32)
    return _aligned_malloc(bytes, LORA_ALIGN);
#else
    void *p = NULL;
    return posix_memalign(&p, LORA_ALIGN, bytes) == 0 ? p : NULL;
#endif
}

void lora_aligned_free(void *p) {
#if defined(_WIN32)
    _aligned_free(p);
#else
    free(p);
#endif
}

LORA_DTYPES(LORA_SIZE_2_OR_4, delta_transpose)

static int64_t round_up_(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* Row length of packed A / B^T: a multiple of LORA_PAD, nudged off multiples
 * of 256 elements.  Rows 4 KiB apart (cols = 4096 in float32) all map to the
 * same L1 set, and a project tile reads up to 8 such rows at once (the
 * accumulate reads one row per rank index): the nudge spreads them over sets.
 * The nudge is one cache line (16 float32, 32 half-precision values), so every
 * row still starts on a line and a 64-byte load of 32 bfloat16 values (the
 * AVX-512 path) never splits one: a 32-byte nudge made every other row's loads
 * split, costing more than the wider loads saved. */
static int64_t packed_ld_(int64_t n, size_t isz) {
    const int64_t ld = round_up_(n, LORA_PAD);
    return ld % 256 == 0 ? ld + LORA_ALIGN / (int64_t)isz : ld;
}

lora_delta *lora_delta_new(int dtype, int64_t rank, int64_t rows, int64_t cols, const void *a,
                           const void *b) {
    if (!lora_dtype_valid(dtype) || rank < 1 || rows < 1 || cols < 1)
        return NULL;
    /* every byte count below must fit: keep each factor under 2^40 and the
     * products under 2^62 */
    const int64_t lim = (int64_t)1 << 40;
    if (rank > lim || rows > lim || cols > lim) return NULL;
    const size_t isz = lora_dtype_size(dtype);
    const int64_t lda = packed_ld_(cols, isz), ldb = packed_ld_(rows, isz);
    if (rank > ((int64_t)1 << 62) / (lda > ldb ? lda : ldb) / 4) return NULL;
    lora_delta *d = (lora_delta *)calloc(1, sizeof *d);
    if (!d) return NULL;
    d->dtype = dtype;
    d->rank = rank, d->rows = rows, d->cols = cols, d->lda = lda, d->ldb = ldb;
    d->owned = 1;
    d->a = lora_aligned_alloc((size_t)(rank * lda) * isz);
    d->bt = lora_aligned_alloc((size_t)(rank * ldb) * isz);
    if (!d->a || !d->bt) {
        lora_delta_free(d);
        return NULL;
    }
    memset(d->a, 0, (size_t)(rank * lda) * isz);
    memset(d->bt, 0, (size_t)(rank * ldb) * isz);
    for (int64_t k = 0; k < rank; k++)
        memcpy((char *)d->a + (size_t)(k * lda) * isz, (const char *)a + (size_t)(k * cols) * isz,
               (size_t)cols * isz);
    /* B [rows, rank] -> B^T [rank, ldb]: one unit-stride row per rank index, by element size */
    if (isz == 4) {
        const uint32_t *src = (const uint32_t *)b;
        uint32_t *dst = (uint32_t *)d->bt;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t k = 0; k < rank; k++) dst[k * ldb + i] = src[i * rank + k];
    } else {
        const uint16_t *src = (const uint16_t *)b;
        uint16_t *dst = (uint16_t *)d->bt;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t k = 0; k < rank; k++) dst[k * ldb + i] = src[i * rank + k];
    }
    return d;
}

lora_delta *lora_delta_view(int dtype, int64_t rank, int64_t rows, int64_t cols, const void *a,
                            int64_t lda, int a_by_row, const void *b, int64_t ldb, int b_by_row) {
    if (!lora_dtype_valid(dtype) || rank < 1 || rows < 1 || cols < 1 ||
        !a || !b)
        return NULL;
    /* each row must hold its values: A rows of cols (A^T rows of rank), B^T rows of rows (B
     * rows of rank) */
    if (lda < (a_by_row ? rank : cols) || ldb < (b_by_row ? rank : rows)) return NULL;
    lora_delta *d = (lora_delta *)calloc(1, sizeof *d);
    if (!d) return NULL;
    d->dtype = dtype;
    d->rank = rank, d->rows = rows, d->cols = cols, d->lda = lda, d->ldb = ldb;
    d->a = (void *)a, d->bt = (void *)b;
    d->a_by_row = a_by_row != 0, d->b_by_row = b_by_row != 0;
    d->owned = 0;
    return d;
}

void lora_delta_free(lora_delta *d) {
    if (!d) return;
    if (d->owned) {
        lora_aligned_free(d->a);
        lora_aligned_free(d->bt);
    }
    free(d);
}

void lora_delta_export(const lora_delta *d, void *a, void *b) {
    const size_t isz = lora_dtype_size(d->dtype);
    if (!d->owned) { /* a view: element by element, whatever its layout */
        for (int64_t k = 0; k < d->rank; k++)
            for (int64_t j = 0; j < d->cols; j++)
                memcpy((char *)a + (size_t)(k * d->cols + j) * isz,
                       (const char *)d->a + (size_t)(d->a_by_row ? j * d->lda + k : k * d->lda + j) * isz, isz);
        for (int64_t i = 0; i < d->rows; i++)
            for (int64_t k = 0; k < d->rank; k++)
                memcpy((char *)b + (size_t)(i * d->rank + k) * isz,
                       (const char *)d->bt + (size_t)(d->b_by_row ? i * d->ldb + k : k * d->ldb + i) * isz, isz);
        return;
    }
    for (int64_t k = 0; k < d->rank; k++)
        memcpy((char *)a + (size_t)(k * d->cols) * isz, (const char *)d->a + (size_t)(k * d->lda) * isz,
               (size_t)d->cols * isz);
    for (int64_t i = 0; i < d->rows; i++)
        for (int64_t k = 0; k < d->rank; k++)
            memcpy((char *)b + (size_t)(i * d->rank + k) * isz,
                   (const char *)d->bt + (size_t)(k * d->ldb + i) * isz, isz);
}


void lora_delta_dims(const lora_delta *d, int64_t *rank, int64_t *rows, int64_t *cols) {
    if (rank) *rank = d->rank;
    if (rows) *rows = d->rows;
    if (cols) *cols = d->cols;
}
