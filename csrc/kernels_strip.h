/*
 * kernels_strip.h - the stack/strip plumbing the SIMD kernel files share
 * (AVX2, AVX-512, NEON; the portable file keeps its own, simpler one).
 *
 * Included by an ISA file inside its target region, after it has defined
 * INLINE_ and these static inline helpers (f: a compile-time LORA_FMT_*, ot:
 * a compile-time LORA_DTYPE_*):
 *   term_(term, i0, i1, nb, outs, obase, f)       one term by rank (M = B^T or A)
 *   term_rows_(term, i0, i1, nb, outs, obase, f)  one term by output (by_row)
 *   widen_(src, n, dst, dt)     float16/bfloat16 -> float32, exact
 *   narrow_(src, n, dst, ot)    float32 -> float16/bfloat16, nearest even
 * where outs[b] + (i - obase) is output i of position b.  It defines
 * terms_() and accumulate_(), the latter being what LORA_KERNEL_TABLE needs.
 * No include guard: every SIMD file compiles its own copy for its target.
 * An ISA may define Q8_0_BATCH_STRIP_ (a multiple of 16, at most
 * LORA_DECODE_STRIP / LORA_NB) for the strips of a batch holding a Q8_0 term.
 */
#ifndef Q8_0_BATCH_STRIP_
#define Q8_0_BATCH_STRIP_ LORA_STRIP
#endif

/* every term of a stack, in order, into the float32 outputs [i0, i1) */
/* one case per storage format of the registry; a term's format was checked
 * when its delta was made (lora_delta_new / lora_delta_view) */
#define STRIP_TERM_CASE_(FN, FMT, NAME, BLOCK, BYTES, VALUE, WORK)                             \
    case FMT: FN(&terms[q], i0, i1, nb, outs, obase, FMT); break;
/* One copy, called by every out dtype's accumulate_ (not inlined: three inlined copies of
 * every format's tiles tripled the file's code and its compile time; a call per strip costs
 * nothing next to a strip's work). */
static __attribute__((noinline)) void terms_(const lora_term *terms, int n_terms, int64_t i0,
                                             int64_t i1, int nb, float *const *outs, int64_t obase) {
    for (int q = 0; q < n_terms; q++) {
        if (terms[q].by_row) {
            switch (terms[q].fmt) {
                LORA_FORMATS(STRIP_TERM_CASE_, term_rows_)
                default: LORA_UNREACHABLE();
            }
            continue;
        }
        switch (terms[q].fmt) {
            LORA_FORMATS(STRIP_TERM_CASE_, term_)
            default: LORA_UNREACHABLE();
        }
    }
}
#undef STRIP_TERM_CASE_

/* a float32 out is updated in place strip by strip; a half out is widened into
 * an L1 strip, every term adds into it in order, then it is rounded once.  A
 * strip's length changes no element's arithmetic.  Output i of position b is
 * at outs[b] + (i - obase). */
INLINE_ void accumulate_(const lora_term *terms, int n_terms, int64_t i0, int64_t i1, int nb,
                         void *const *outs, int64_t obase, const int ot) {
    /* a decode's strips are longer: its tiles read every M row in long runs; so are a batch's
     * where the ISA walks Q8_0 terms (Q8_0_BATCH_STRIP_: each strip widens its rows' scales) */
    int q8 = 0;
    for (int q = 0; nb > 1 && Q8_0_BATCH_STRIP_ != LORA_STRIP && q < n_terms; q++)
        q8 |= terms[q].fmt == LORA_FMT_Q8_0;
    const int64_t len = nb == 1 ? LORA_DECODE_STRIP : q8 ? Q8_0_BATCH_STRIP_ : LORA_STRIP;
    if (ot == LORA_DTYPE_F32) {
        /* a strip of outputs stays in L1 while every term adds into it */
        for (int64_t i = i0; i < i1; i += len)
            terms_(terms, n_terms, i, i + len < i1 ? i + len : i1, nb, (float *const *)outs, obase);
        return;
    }
    int touched[LORA_NB] = {0};
    for (int q = 0; q < n_terms; q++)
        for (int b = 0; b < nb; b++) touched[b] |= terms[q].scale[b] != 0.0f;
    float strip[LORA_NB * LORA_STRIP > LORA_DECODE_STRIP ? LORA_NB * LORA_STRIP : LORA_DECODE_STRIP];
    for (int64_t i = i0; i < i1; i += len) {
        const int64_t n = i1 - i < len ? i1 - i : len;
        float *so[LORA_NB];
        for (int b = 0; b < nb; b++) {
            so[b] = strip + b * len;  /* output i at so[b][i - i_strip] */
            if (touched[b])
                widen_((const char *)outs[b] + (i - obase) * lora_dtype_size(ot), n, so[b], ot);
        }
        terms_(terms, n_terms, i, i + n, nb, so, i);
        for (int b = 0; b < nb; b++)
            if (touched[b]) narrow_(so[b], n, (char *)outs[b] + (i - obase) * lora_dtype_size(ot), ot);
    }
}
