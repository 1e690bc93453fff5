/*
 * kernels_pairs.h - the loops around the tiles of the NEON path:
 * positions two at a time (a constant pair size keeps every accumulator of a
 * tile in a register), ranks PROJECT_RANKS_ at a time and then one at a time.
 * The tiles themselves, with their instructions, widths and horizontal sums,
 * stay in the ISA file; a path whose tiles take another number of positions
 * writes these loops itself (AVX-512 and AVX2 do: up to 4 positions per tile).
 *
 * Included by an ISA file inside its target region, after it has defined
 * INLINE_, PROJECT_RANKS_ and
 *   project_tile_(a, lda, cols, k, nr, nb, xs, t, ldt, f, xt)
 *       ranks k .. k + nr of nb positions, nr in {1, PROJECT_RANKS_}, nb in {1, 2}
 *   term_nb_(m, ldm, kdim, i0, i1, nb, u, ldu, scale, outs, obase, f)
 *       one term over outputs [i0, i1) of nb positions, nb in {1, 2}
 * It defines project_() (what LORA_KERNEL_TABLE needs) and term_() (what
 * kernels_strip.h needs).  Neither changes a summation order: each output
 * element is computed whole by one tile call, whichever pair or rank group
 * it falls in.  No include guard: every file compiles its own copy.
 */

INLINE_ void project_(lora_run a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                      int nb, const void *const *xs, float *t, int64_t ldt, const int f,
                      const int xt) {
    for (int b = 0; b < nb; b += 2) {
        const void *const *xb = xs + b;
        float *tb = t + b * ldt;
        int64_t k = k0;
        if (nb - b >= 2) {
            for (; k + PROJECT_RANKS_ <= k1; k += PROJECT_RANKS_)
                project_tile_(a, lda, cols, k, PROJECT_RANKS_, 2, xb, tb, ldt, f, xt);
            for (; k < k1; k++) project_tile_(a, lda, cols, k, 1, 2, xb, tb, ldt, f, xt);
        } else {
            for (; k + PROJECT_RANKS_ <= k1; k += PROJECT_RANKS_)
                project_tile_(a, lda, cols, k, PROJECT_RANKS_, 1, xb, tb, ldt, f, xt);
            for (; k < k1; k++) project_tile_(a, lda, cols, k, 1, 1, xb, tb, ldt, f, xt);
        }
    }
}

INLINE_ void term_(const lora_term *tm, int64_t i0, int64_t i1, int nb, float *const *outs,
                   int64_t obase, const int f) {
    for (int b = 0; b < nb; b += 2) {
        if (nb - b >= 2)
            term_nb_(tm->m, tm->ldm, tm->kdim, i0, i1, 2, tm->u + b * tm->ldu, tm->ldu,
                     tm->scale + b, outs + b, obase, f);
        else
            term_nb_(tm->m, tm->ldm, tm->kdim, i0, i1, 1, tm->u + b * tm->ldu, tm->ldu,
                     tm->scale + b, outs + b, obase, f);
    }
}
