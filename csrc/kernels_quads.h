/*
 * kernels_quads.h - term_() for the paths whose accumulate tiles take up to
 * LORA_NB (4) positions at once (AVX2, AVX-512): one call of the file's own
 * term_nb_ per block, with nb a compile-time constant so that the compiler
 * keeps every accumulator of a tile in a register.  It changes no summation
 * order: each output element is computed whole by one tile call.
 *
 * Included by an ISA file inside its target region, after it has defined
 * INLINE_ and
 *   term_nb_(m, ldm, kdim, i0, i1, nb, u, ldu, scale, outs, obase, f)
 *       one term over outputs [i0, i1) of nb positions, nb in 1 .. LORA_NB
 * It defines term_() (what kernels_strip.h needs).  No include guard: every
 * file compiles its own copy.
 */

INLINE_ void term_(const lora_term *tm, int64_t i0, int64_t i1, int nb, float *const *outs,
                   int64_t obase, const int f) {
    switch (nb) {
    case 1: term_nb_(tm->m, tm->ldm, tm->kdim, i0, i1, 1, tm->u, tm->ldu, tm->scale, outs, obase, f); break;
    case 2: term_nb_(tm->m, tm->ldm, tm->kdim, i0, i1, 2, tm->u, tm->ldu, tm->scale, outs, obase, f); break;
    case 3: term_nb_(tm->m, tm->ldm, tm->kdim, i0, i1, 3, tm->u, tm->ldu, tm->scale, outs, obase, f); break;
    default: term_nb_(tm->m, tm->ldm, tm->kdim, i0, i1, 4, tm->u, tm->ldu, tm->scale, outs, obase, f); break;
    }
}
