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

/* The packing and the export know the element formats (values as they are) and Q8_0
 * (llama.cpp's blocks: a float16 d, then 32 int8 q) */
LORA_FORMATS_HANDLED(4, delta_packing_knows_the_element_formats_and_q8_0);

/* a block of llama.cpp's Q8_0 (block_q8_0): the scale's bits, then the values */
#define Q8_0_BLOCK_BYTES 34

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

/* an own, zeroed factor of n rows of `len` values in format fmt (rows padded, see
 * packed_ld_); LORA_OK or LORA_ERR_NOMEM */
static int alloc_factor_(lora_factor *f, int fmt, int64_t n, int64_t len) {
    const size_t isz = lora_format_value_size(fmt);
    f->fmt = fmt, f->by_row = 0, f->d = NULL;
    f->ld = packed_ld_(len, isz);
    f->v = lora_aligned_alloc((size_t)(n * f->ld) * isz);
    if (!f->v) return LORA_ERR_NOMEM;
    const int64_t block = lora_format_block(fmt);
    /* value 0: a Q8_0 value is kept biased (formats.h), so its zero is the byte 0x80 */
    memset(f->v, fmt == LORA_FMT_Q8_0 ? LORA_Q8_0_BIAS : 0, (size_t)(n * f->ld) * isz);
    if (block > 1) { /* a block format's scales, ld / block a row; the padding's are 0 */
        const size_t nd = (size_t)(n * (f->ld / block));
        f->d = (uint16_t *)lora_aligned_alloc(nd * sizeof(uint16_t));
        if (!f->d) return LORA_ERR_NOMEM;
        memset(f->d, 0, nd * sizeof(uint16_t));
    }
    return LORA_OK;
}

/* Q8_0 blocks: row r of src (ceil(len / 32) blocks of 34 bytes) into the factor's row r,
 * its values biased in v (q ^ 0x80: formats.h), its scales in d; a short last block's values
 * past len stay 0 */
static void pack_q8_0_(lora_factor *f, int64_t n, int64_t len, const void *src) {
    const int64_t nblk = (len + 31) / 32, dper = f->ld / 32;
    const unsigned char *sp = (const unsigned char *)src;
    for (int64_t r = 0; r < n; r++)
        for (int64_t k = 0; k < nblk; k++) {
            const unsigned char *blk = sp + (size_t)((r * nblk + k) * Q8_0_BLOCK_BYTES);
            const int64_t m = len - 32 * k < 32 ? len - 32 * k : 32;
            f->d[r * dper + k] = (uint16_t)(blk[0] | (unsigned)blk[1] << 8);
            uint8_t *v = (uint8_t *)f->v + r * f->ld + 32 * k;
            for (int64_t l = 0; l < m; l++) v[l] = (uint8_t)(blk[2 + l] ^ LORA_Q8_0_BIAS);
        }
}

/* the blocks back: row r of the factor as ceil(len / 32) blocks at dst (the padding's
 * values, 0, fill a short block) */
static void export_q8_0_(const lora_factor *f, int64_t n, int64_t len, void *dst) {
    const int64_t nblk = (len + 31) / 32, dper = f->ld / 32;
    unsigned char *dp = (unsigned char *)dst;
    for (int64_t r = 0; r < n; r++)
        for (int64_t k = 0; k < nblk; k++) {
            unsigned char *blk = dp + (size_t)((r * nblk + k) * Q8_0_BLOCK_BYTES);
            const uint16_t d = f->d[r * dper + k];
            blk[0] = (unsigned char)(d & 0xffu), blk[1] = (unsigned char)(d >> 8);
            const uint8_t *v = (const uint8_t *)f->v + r * f->ld + 32 * k;
            for (int l = 0; l < 32; l++) blk[2 + l] = (unsigned char)(v[l] ^ LORA_Q8_0_BIAS);
        }
}

/* one element format's values: row r of src [n, len] (src_by_col: element (r, c) at
 * src[c * n + r], the transposition of B into B^T) into the factor's row r */
static void pack_values_(lora_factor *f, int64_t n, int64_t len, const void *src, int src_by_col) {
    const size_t isz = lora_format_value_size(f->fmt);
    if (!src_by_col) {
        for (int64_t r = 0; r < n; r++)
            memcpy((char *)f->v + (size_t)(r * f->ld) * isz, (const char *)src + (size_t)(r * len) * isz,
                   (size_t)len * isz);
        return;
    }
    /* one unit-stride row per rank index, by element size */
    if (isz == 4) {
        const uint32_t *sp = (const uint32_t *)src;
        uint32_t *dp = (uint32_t *)f->v;
        for (int64_t c = 0; c < len; c++)
            for (int64_t r = 0; r < n; r++) dp[r * f->ld + c] = sp[c * n + r];
    } else {
        const uint16_t *sp = (const uint16_t *)src;
        uint16_t *dp = (uint16_t *)f->v;
        for (int64_t c = 0; c < len; c++)
            for (int64_t r = 0; r < n; r++) dp[r * f->ld + c] = sp[c * n + r];
    }
}

static void free_factor_(lora_factor *f) {
    lora_aligned_free(f->v);
    lora_aligned_free(f->d);
    f->v = NULL, f->d = NULL;
}

lora_delta *lora_delta_new(int a_fmt, int b_fmt, int64_t rank, int64_t rows, int64_t cols,
                           const void *a, const void *b) {
    if (!lora_format_valid(a_fmt) || !lora_format_valid(b_fmt) || rank < 1 || rows < 1 ||
        cols < 1 || !a || !b)
        return NULL;
    /* every byte count below must fit: keep each factor under 2^40 and the
     * products under 2^62 */
    const int64_t lim = (int64_t)1 << 40;
    if (rank > lim || rows > lim || cols > lim) return NULL;
    const int64_t longest = (cols > rows ? cols : rows) + 256;
    if (rank > ((int64_t)1 << 62) / longest / 4) return NULL;
    lora_delta *d = (lora_delta *)calloc(1, sizeof *d);
    if (!d) return NULL;
    d->rank = rank, d->rows = rows, d->cols = cols;
    d->owned = 1;
    if (alloc_factor_(&d->a, a_fmt, rank, cols) != LORA_OK ||
        alloc_factor_(&d->bt, b_fmt, rank, rows) != LORA_OK) {
        lora_delta_free(d);
        return NULL;
    }
    if (a_fmt == LORA_FMT_Q8_0) pack_q8_0_(&d->a, rank, cols, a);
    else pack_values_(&d->a, rank, cols, a, 0);
    /* B [rows, rank] -> B^T [rank, ldb]: one unit-stride row per rank index (a block
     * format comes as B^T's blocks already) */
    if (b_fmt == LORA_FMT_Q8_0) pack_q8_0_(&d->bt, rank, rows, b);
    else pack_values_(&d->bt, rank, rows, b, 1);
    return d;
}

lora_delta *lora_delta_view(int fmt, int64_t rank, int64_t rows, int64_t cols, const void *a,
                            int64_t lda, int a_by_row, const void *b, int64_t ldb, int b_by_row) {
    if (!lora_format_valid(fmt) || lora_format_block(fmt) != 1 || rank < 1 || rows < 1 ||
        cols < 1 || !a || !b)
        return NULL;
    /* each row must hold its values: A rows of cols (A^T rows of rank), B^T rows of rows (B
     * rows of rank) */
    if (lda < (a_by_row ? rank : cols) || ldb < (b_by_row ? rank : rows)) return NULL;
    lora_delta *d = (lora_delta *)calloc(1, sizeof *d);
    if (!d) return NULL;
    d->rank = rank, d->rows = rows, d->cols = cols;
    d->a.v = (void *)a, d->a.ld = lda, d->a.fmt = fmt, d->a.by_row = a_by_row != 0;
    d->bt.v = (void *)b, d->bt.ld = ldb, d->bt.fmt = fmt, d->bt.by_row = b_by_row != 0;
    d->owned = 0;
    return d;
}

void lora_delta_free(lora_delta *d) {
    if (!d) return;
    if (d->owned) {
        free_factor_(&d->a);
        free_factor_(&d->bt);
    }
    free(d);
}

/* element (r, c) of a factor held as [n, len] rows (by_row: as [len, n]) into dst, one
 * value of its format's value size */
static void export_value_(const lora_factor *f, int64_t r, int64_t c, void *dst) {
    const size_t isz = lora_format_value_size(f->fmt);
    memcpy(dst, (const char *)f->v + (size_t)(f->by_row ? c * f->ld + r : r * f->ld + c) * isz, isz);
}

void lora_delta_export(const lora_delta *d, void *a, void *b) {
    const size_t ia = lora_format_value_size(d->a.fmt), ib = lora_format_value_size(d->bt.fmt);
    /* a block format is never a view (lora_delta_view), so never held by row */
    if (d->a.fmt == LORA_FMT_Q8_0) export_q8_0_(&d->a, d->rank, d->cols, a);
    if (d->bt.fmt == LORA_FMT_Q8_0) export_q8_0_(&d->bt, d->rank, d->rows, b);
    for (int64_t k = 0; k < d->rank && d->a.fmt != LORA_FMT_Q8_0; k++) {
        if (!d->a.by_row) { /* a row of A is a run of values */
            memcpy((char *)a + (size_t)(k * d->cols) * ia, (const char *)d->a.v + (size_t)(k * d->a.ld) * ia,
                   (size_t)d->cols * ia);
            continue;
        }
        for (int64_t j = 0; j < d->cols; j++)
            export_value_(&d->a, k, j, (char *)a + (size_t)(k * d->cols + j) * ia);
    }
    for (int64_t i = 0; i < d->rows && d->bt.fmt != LORA_FMT_Q8_0; i++)
        for (int64_t k = 0; k < d->rank; k++)
            export_value_(&d->bt, k, i, (char *)b + (size_t)(i * d->rank + k) * ib);
}

void lora_delta_dims(const lora_delta *d, int64_t *rank, int64_t *rows, int64_t *cols) {
    if (rank) *rank = d->rank;
    if (rows) *rows = d->rows;
    if (cols) *cols = d->cols;
}
