/*
 * kernels_merge.h - the merges' row kernel (lora_merge_row_<isa>, see
 * merge.c): acc[j] += s * sum_k b[k] * a[k * lda + j] for j < n, in float64.
 *
 * Portable C, the same for every ISA: each ISA file includes it inside its
 * target region, so the compiler vectorises it over j for that ISA.  The sum
 * over k runs in order from the first product (a product, then a sum: the
 * build's -ffp-contract=off keeps fma out), then is scaled and added, so
 * every path gives the same bits: NumPy's t = b[0] * a[0]; t = t + b[k] *
 * a[k] ...; acc = acc + s * t, element by element.  n <= LORA_MERGE_CHUNK.
 * No include guard: every file compiles its own copy for its target.
 */

LORA_INLINE void merge_row_(const double *b, int64_t rank, const double *a, int64_t lda,
                              int64_t n, double s, double *acc) {
    double t[LORA_MERGE_CHUNK];
    const double b0 = b[0];
    for (int64_t j = 0; j < n; j++) t[j] = b0 * a[j];
    for (int64_t k = 1; k < rank; k++) {
        const double bk = b[k], *ak = a + k * lda;
        for (int64_t j = 0; j < n; j++) t[j] = t[j] + bk * ak[j];
    }
    for (int64_t j = 0; j < n; j++) acc[j] = acc[j] + s * t[j];
}
