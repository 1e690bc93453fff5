/*
 * kernels_tails.h - the scalar tails of the SIMD paths without masked loads
 * (AVX2, NEON): the columns past the last whole vector of a dot product, the
 * outputs past the last whole tile of an accumulate, and the elements past
 * the last whole vector of a widening or a rounding.
 *
 * Included by an ISA file inside its target region (so fmaf is that target's
 * fused multiply-add: vfmadd on x86 with FMA, fmadd on aarch64), after it
 * has defined INLINE_ and
 *   load_f32_(p, i, dt)          element i of a dtype array as float32, exact
 *   run_f32_(r, e, f)            value e of a factor run in format f as float32, exact
 *   VEC_LANES_                   float32 lanes of one vector
 *   widen_vec_(src, i, dst, dt)  dst[i .. i + VEC_LANES_) = src widened, exact
 *   narrow_vec_(src, i, dst, ot) dst[i .. i + VEC_LANES_) = src rounded to
 *                                nearest even into ot (float16, bfloat16)
 * load_f32_ converts a single half with whatever instruction that ISA has (an
 * exact conversion gives the same value whichever instruction does it).
 * Every tail of a sum is an fma chain from 0 in ascending order, the same
 * chain a vector lane runs, which is what the ISA files' summation orders
 * say the tails are; a rounding tail is lora_store_f32, which the vector
 * rounding matches bit for bit.  It defines fma_tail_, term_lanes_, widen_
 * and narrow_.  No include guard: every file compiles its own copy.
 */

/* fma-chain from 0 over j < n, ascending, of a[ia + j] * x[ix + j] (a a factor
 * run in format f, x in dtype xt) */
INLINE_ float fma_tail_(lora_run a, int64_t ia, const int f, const void *x, int64_t ix,
                        const int xt, int64_t n) {
    float acc = 0.0f;
    for (int64_t j = 0; j < n; j++)
        acc = fmaf(run_f32_(a, ia + j, f), load_f32_(x, ix + j, xt), acc);
    return acc;
}

/* One term over outputs [i0, i1) of nb positions, one output at a time: the
 * blocked chains of the accumulate order (an fma chain from 0 over each
 * LORA_KBLOCK of k, the blocks' sums added in order), then out = fma(total,
 * s, out).  Output i of position b lives at outs[b][i - obase]. */
INLINE_ void term_lanes_(lora_run m, int64_t ldm, int64_t kdim, int64_t i0, int64_t i1,
                         const int nb, const float *u, int64_t ldu, const float *scale,
                         float *const *outs, int64_t obase, const int f) {
    for (int64_t i = i0; i < i1; i++) {
        for (int b = 0; b < nb; b++) {
            if (scale[b] == 0.0f) continue;
            float total = 0.0f;
            for (int64_t k0 = 0; k0 < kdim; k0 += LORA_KBLOCK) {
                const int64_t k1 = k0 + LORA_KBLOCK < kdim ? k0 + LORA_KBLOCK : kdim;
                float block = 0.0f;
                for (int64_t k = k0; k < k1; k++)
                    block = fmaf(run_f32_(m, k * ldm + i, f), u[b * ldu + k], block);
                total = k0 == 0 ? block : total + block;
            }
            outs[b][i - obase] = fmaf(total, scale[b], outs[b][i - obase]);
        }
    }
}

/* dst[i] = src[i] as float32 for i < n (dt: float16 or bfloat16) */
INLINE_ void widen_(const void *src, int64_t n, float *dst, const int dt) {
    int64_t i = 0;
    for (; i + VEC_LANES_ <= n; i += VEC_LANES_) widen_vec_(src, i, dst, dt);
    for (; i < n; i++) dst[i] = load_f32_(src, i, dt);
}

/* dst[i] = src[i] rounded to nearest even into ot (float16 or bfloat16) for i < n */
INLINE_ void narrow_(const float *src, int64_t n, void *dst, const int ot) {
    int64_t i = 0;
    for (; i + VEC_LANES_ <= n; i += VEC_LANES_) narrow_vec_(src, i, dst, ot);
    for (; i < n; i++) lora_store_f32(dst, i, src[i], ot);
}
