/*
 * kernels_neon.c - the NEON (AdvSIMD) path for aarch64 (every ARMv8-A CPU:
 * Cortex-A53 .. X4, Neoverse N1/V1/V2, Apple M1 and later, Graviton).
 *
 * Required features: AdvSIMD and its FP16 conversions, both baseline on
 * aarch64, so nothing is checked at run time and no target pragma is needed
 * (isa.c makes this the best path whenever the file is compiled in).
 * Instructions: fmla (vfmaq_f32) on 4-lane float32x4 registers; float16
 * storage and activations are widened with fcvtl (vcvt_f32_f16, exact),
 * Q8_0 storage with eor (its bias off) + sxtl + scvtf and one fmul by its
 * block's scale (exact),
 * bfloat16 with ushll #16 (vshll_n_u16: a bfloat16 is the top half of a
 * float32, so the shift is exact); a float16 out is narrowed with fcvtn
 * (vcvt_f16_f32: round to nearest even under the default FPCR, subnormals
 * kept, overflow to inf, a NaN quieted with its top payload bits: the same
 * bits as lora_f32_to_f16), a bfloat16 out with the integer
 * round-to-nearest-even of lora_f32_to_bf16 (BFCVTN is ARMv8.6, not
 * baseline).
 *
 * Summation order (one per output element, shared by decode, batch, stack
 * and bank, and by every dtype of x and out: x is widened exactly in
 * registers, a half-precision out is widened into a float32 strip before the
 * first term and rounded to nearest even once after the last):
 *   project     t[k] = ((r_0 + r_1) + r_2) ... + tail, one r_m per column
 *               block m ([m, m+1) x LORA_JBLOCK within cols rounded down to
 *               8; a row of up to 4096 columns is one block), r_m =
 *               hsum8(lanes), lane l (0..7) = fma-chain from 0 over the
 *               block's j = l (mod 8), ascending (two float32x4 registers:
 *               lanes 0-3 and 4-7);
 *               hsum8 = ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7)) (the two
 *               registers added, then two explicit pairwise adds, faddp);
 *               tail = fma-chain from 0 over the last cols mod 8 values,
 *               ascending.
 *   accumulate  out[i] = out[i] + ((blk_0 + blk_1) + blk_2 ...), blk_m =
 *               fma-chain from 0 over k in [16m, 16m+16) ascending of
 *               M[k,i]*u[k] (LORA_KBLOCK), then out[i] = fma(total, s,
 *               out[i]) (one rounding), term by term in stack order; vector
 *               lanes and the scalar tail (fmaf, a single fmadd on aarch64)
 *               give the same bits.
 *   by_row      (a term held by output, a caller's lora_B [out, r]) out[i] =
 *               fma(hsum8(lanes) + tail, s, out[i]), lanes and tail as in
 *               project over k, one block whatever the rank.
 * Tail strategy: a short scalar tail (cols mod 8 in project, the last
 * rows mod 4 outputs in accumulate), the fma chains of kernels_tails.h that
 * the AVX2 file shares: fmaf keeps each lane's fma-chain, so a value's bits
 * do not depend on whether it fell in a vector or in the tail of some strip.
 * Accumulators: project keeps 4 ranks x 2 positions x 2 registers = 16
 * independent fma chains (FMA latency 4 x up to 4 FMA pipes on Neoverse
 * V1/V2 = 16 in flight; 2-pipe cores are saturated with room to spare) plus
 * 4 x and 2 A registers = 22 of the 32 vector registers; accumulate keeps 4
 * row vectors x 2 positions = 8 block chains (latency 4 x 2 pipes) plus
 * their 8 running totals, 4 M and 2 u registers = 22 of 32.
 */
#include "kernels.h"

#if defined(LORA_HAVE_NEON)
#include <arm_neon.h>
#include <math.h>

#define INLINE_ static inline __attribute__((always_inline))

/* The loads and the rounding (narrow_vec_) below know float32, float16 and
 * bfloat16, the last one in each being bfloat16. */
LORA_DTYPES_HANDLED(3, neon_loads_and_roundings_know_f32_f16_bf16);

/* 4 values of a dtype array from element i, as float32 (exact) */
INLINE_ float32x4_t load_f32x4_(const void *p, int64_t i, const int dt) {
    if (dt == LORA_DTYPE_F32) return vld1q_f32((const float *)p + i);
    const uint16x4_t h = vld1_u16((const uint16_t *)p + i);
    if (dt == LORA_DTYPE_F16) return vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}

INLINE_ float load_f32_(const void *p, int64_t i, const int dt) {
    if (dt == LORA_DTYPE_F32) return ((const float *)p)[i];
    if (dt == LORA_DTYPE_F16) return (float)((const __fp16 *)p)[i];  /* fcvt, exact */
    return lora_bf16_to_f32(((const uint16_t *)p)[i]);
}

/* A run of a factor's values as float32 (exact): 4 of them, and one (the
 * table's loader, load_run_, follows the tails).  The one place this file
 * reads a storage format; an element format is its dtype's values; a Q8_0
 * value is d * q (q kept biased, formats.h: one eor takes the bias off four
 * values; then sxtl twice, scvtf, one fmul by the block's float16 scale
 * widened with fcvt: an 8-bit integer times a float16 is exact in float32),
 * so a Q8_0 factor is summed in float32's order.  Vector runs start at
 * multiples of 4 (rows are multiples of 32 long, tiles and thread splits step
 * by 4), so 4 values never straddle two blocks: one scale a vector. */
LORA_FORMATS_HANDLED(4, neon_run_loads_know_f32_f16_bf16_q8_0);
INLINE_ float q8_0_scale_(lora_run r, int64_t e) { return (float)((const __fp16 *)r.d)[e >> 5]; }

INLINE_ float32x4_t run_f32x4_(lora_run r, int64_t e, const int f) {
    if (f == LORA_FMT_Q8_0) {
        uint32_t raw;
        memcpy(&raw, (const uint8_t *)r.v + e, sizeof raw); /* 4 stored values, any alignment */
        raw ^= LORA_Q8_0_BIAS * 0x01010101u;                 /* the bias off: 4 int8 q */
        const int16x8_t q_s16x8 = vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(raw)));
        const float32x4_t q_f32x4 = vcvtq_f32_s32(vmovl_s16(vget_low_s16(q_s16x8)));
        return vmulq_n_f32(q_f32x4, q8_0_scale_(r, e));
    }
    return load_f32x4_(r.v, e, f);
}
INLINE_ float run_f32_(lora_run r, int64_t e, const int f) {
    if (f == LORA_FMT_Q8_0) return (float)lora_q8_0_q(r.v, e) * q8_0_scale_(r, e);
    return load_f32_(r.v, e, f);
}

/* (v0+v1) + (v2+v3), written out with faddp so the tree does not depend on
 * how a compiler lowers vaddvq_f32 */
INLINE_ float hsum_f32x4_(float32x4_t v) {
    const float32x4_t p = vpaddq_f32(v, v);  /* [v0+v1, v2+v3, v0+v1, v2+v3] */
    return vpadds_f32(vget_low_f32(p));     /* (v0+v1) + (v2+v3) */
}

/* ((lo0+hi0)+(lo1+hi1)) + ((lo2+hi2)+(lo3+hi3)) */
INLINE_ float hsum_f32x4x2_(float32x4_t lo, float32x4_t hi) {
    return hsum_f32x4_(vaddq_f32(lo, hi));
}

/* One whole vector of the widening and the rounding: dst[i .. i + VEC_LANES_)
 * (the loops and their tails: widen_ and narrow_ in kernels_tails.h) */
#define VEC_LANES_ 4
INLINE_ void widen_vec_(const void *src, int64_t i, float *dst, const int dt) {
    vst1q_f32(dst + i, load_f32x4_(src, i, dt));
}

/* rounded to nearest even into ot (float16 or bfloat16), bit-identical to
 * lora_store_f32 (the scalar tail) */
INLINE_ void narrow_vec_(const float *src, int64_t i, void *dst, const int ot) {
    const float32x4_t v = vld1q_f32(src + i);
    uint16x4_t h;
    if (ot == LORA_DTYPE_F16) {
        h = vreinterpret_u16_f16(vcvt_f16_f32(v));
    } else {
        const uint32x4_t u = vreinterpretq_u32_f32(v);
        const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
        const uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb), 16);
        const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)),
                                         vdupq_n_u32(0x7f800000));
        const uint32x4_t quiet = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40));
        h = vmovn_u32(vbslq_u32(nan, quiet, r));
    }
    vst1_u16((uint16_t *)dst + i, h);
}

#include "kernels_tails.h"

INLINE_ void load_run_(lora_run r, int64_t e, int64_t n, float *dst, const int f) {
    if (lora_format_block(f) == 1) {
        widen_((const char *)r.v + e * (int64_t)lora_format_value_size(f), n, dst, f);
        return;
    }
    int64_t k = 0;
    for (; k < n && (e + k) % 4; k++) dst[k] = run_f32_(r, e + k, f);
    for (; k + 4 <= n; k += 4) vst1q_f32(dst + k, run_f32x4_(r, e + k, f));
    for (; k < n; k++) dst[k] = run_f32_(r, e + k, f);
}

/* nr ranks (k .. k+nr) x nb positions; nr in {1, PROJECT_RANKS_}, nb in {1, 2} */
#define PROJECT_RANKS_ 4
INLINE_ void project_tile_(lora_run a, int64_t lda, int64_t cols, int64_t k, const int nr,
                           const int nb, const void *const *xs, float *t, int64_t ldt,
                           const int f, const int xt) {
    float sum[PROJECT_RANKS_][2] = {{0}}; /* the finished column blocks' sums */
    const int64_t body = cols & ~(int64_t)7;
    for (int64_t jb = 0; jb < body; jb += LORA_JBLOCK) {
        const int64_t je = jb + LORA_JBLOCK < body ? jb + LORA_JBLOCK : body;
        float32x4_t acc_f32x4[PROJECT_RANKS_][2][2];
        for (int r = 0; r < nr; r++)
            for (int b = 0; b < nb; b++)
                acc_f32x4[r][b][0] = acc_f32x4[r][b][1] = vdupq_n_f32(0.0f);
        for (int64_t j = jb; j < je; j += 8) {
            float32x4_t x_f32x4[2][2];
            for (int b = 0; b < nb; b++) {
                x_f32x4[b][0] = load_f32x4_(xs[b], j, xt);
                x_f32x4[b][1] = load_f32x4_(xs[b], j + 4, xt);
            }
            for (int r = 0; r < nr; r++) {
                const float32x4_t a0_f32x4 = run_f32x4_(a, (k + r) * lda + j, f);
                const float32x4_t a1_f32x4 = run_f32x4_(a, (k + r) * lda + j + 4, f);
                for (int b = 0; b < nb; b++) {
                    acc_f32x4[r][b][0] = vfmaq_f32(acc_f32x4[r][b][0], a0_f32x4, x_f32x4[b][0]);
                    acc_f32x4[r][b][1] = vfmaq_f32(acc_f32x4[r][b][1], a1_f32x4, x_f32x4[b][1]);
                }
            }
        }
        for (int r = 0; r < nr; r++)
            for (int b = 0; b < nb; b++) {
                const float block = hsum_f32x4x2_(acc_f32x4[r][b][0], acc_f32x4[r][b][1]);
                sum[r][b] = jb == 0 ? block : sum[r][b] + block;
            }
    }
    for (int r = 0; r < nr; r++) {
        for (int b = 0; b < nb; b++) {
            const float tail = fma_tail_(a, (k + r) * lda + body, f, xs[b], body, xt, cols - body);
            t[b * ldt + k + r] = sum[r][b] + tail;
        }
    }
}

/* outputs i .. i + 4*nv of nb positions; nv in {1, 4}, nb in {1, 2} */
INLINE_ void term_tile_neon_(lora_run m, int64_t ldm, int64_t kdim, int64_t i, const int nv,
                        const int nb, const float *u, int64_t ldu, const float *scale,
                        float *const *outs, int64_t obase, const int f) {
    float32x4_t total_f32x4[4][2], block_f32x4[4][2];
    for (int v = 0; v < nv; v++)  /* kdim >= 1 overwrites these; zeroed for the compiler's sake */
        for (int b = 0; b < nb; b++) total_f32x4[v][b] = vdupq_n_f32(0.0f);
    for (int64_t k0 = 0; k0 < kdim; k0 += LORA_KBLOCK) {
        const int64_t k1 = k0 + LORA_KBLOCK < kdim ? k0 + LORA_KBLOCK : kdim;
        for (int v = 0; v < nv; v++)
            for (int b = 0; b < nb; b++) block_f32x4[v][b] = vdupq_n_f32(0.0f);
        for (int64_t k = k0; k < k1; k++) {
            float32x4_t m_f32x4[4];
            for (int v = 0; v < nv; v++) m_f32x4[v] = run_f32x4_(m, k * ldm + i + 4 * v, f);
            for (int b = 0; b < nb; b++) {
                const float32x4_t u_f32x4 = vdupq_n_f32(u[b * ldu + k]);
                for (int v = 0; v < nv; v++)
                    block_f32x4[v][b] = vfmaq_f32(block_f32x4[v][b], m_f32x4[v], u_f32x4);
            }
        }
        for (int v = 0; v < nv; v++)
            for (int b = 0; b < nb; b++)
                total_f32x4[v][b] = k0 == 0 ? block_f32x4[v][b]
                                            : vaddq_f32(total_f32x4[v][b], block_f32x4[v][b]);
    }
    for (int b = 0; b < nb; b++) {
        if (scale[b] == 0.0f) continue;
        const float32x4_t s_f32x4 = vdupq_n_f32(scale[b]);
        for (int v = 0; v < nv; v++) {
            float *o = outs[b] + (i - obase) + 4 * v;
            vst1q_f32(o, vfmaq_f32(vld1q_f32(o), total_f32x4[v][b], s_f32x4));
        }
    }
}

/* one term over outputs [i0, i1) of nb positions; output i lives at
 * outs[b][i - obase] */
INLINE_ void term_nb_(lora_run m, int64_t ldm, int64_t kdim, int64_t i0, int64_t i1,
                      const int nb, const float *u, int64_t ldu, const float *scale,
                      float *const *outs, int64_t obase, const int f) {
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16) term_tile_neon_(m, ldm, kdim, i, 4, nb, u, ldu, scale, outs, obase, f);
    for (; i + 4 <= i1; i += 4) term_tile_neon_(m, ldm, kdim, i, 1, nb, u, ldu, scale, outs, obase, f);
    /* the same blocked chains, one lane at a time */
    term_lanes_(m, ldm, kdim, i, i1, nb, u, ldu, scale, outs, obase, f);
}

#include "kernels_pairs.h"

/* A term held by output (by_row): out[i] += s * dot(M^T[i, :], u) for i in [i0, i1); each
 * row's dot product is the project order (lanes k mod 8 in two float32x4 chains, hsum8, then
 * the scalar tail), so a row's bits never depend on its neighbours or its thread. */
INLINE_ void term_rows_(const lora_term *tm, int64_t i0, int64_t i1, int nb, float *const *outs,
                        int64_t obase, const int f) {
    const int64_t kdim = tm->kdim, ldm = tm->ldm, body = kdim & ~(int64_t)7;
    for (int b = 0; b < nb; b++) {
        const float s = tm->scale[b];
        if (s == 0.0f) continue;
        const float *u = tm->u + b * tm->ldu;
        for (int64_t i = i0; i < i1; i++) {
            const int64_t row = i * ldm;
            float32x4_t lo_f32x4 = vdupq_n_f32(0.0f), hi_f32x4 = vdupq_n_f32(0.0f);
            for (int64_t k = 0; k < body; k += 8) {
                lo_f32x4 = vfmaq_f32(lo_f32x4, run_f32x4_(tm->m, row + k, f), vld1q_f32(u + k));
                hi_f32x4 = vfmaq_f32(hi_f32x4, run_f32x4_(tm->m, row + k + 4, f),
                                     vld1q_f32(u + k + 4));
            }
            const float tail =
                fma_tail_(tm->m, row + body, f, u, body, LORA_DTYPE_F32, kdim - body);
            float *o = outs[b] + (i - obase);
            *o = fmaf(hsum_f32x4x2_(lo_f32x4, hi_f32x4) + tail, s, *o);
        }
    }
}

#include "kernels_strip.h"
#include "kernels_merge.h"

#define READ_F32V_ float32x4_t
#define READ_LANES_ 4
#define read_zero_() vdupq_n_f32(0.0f)
#define read_load_(p) vld1q_f32(p)
#define read_add_(a, b) vaddq_f32(a, b)
#define read_hsum_(v) hsum_f32x4_(v)
#define read_set1_(f) vdupq_n_f32(f)
#define read_fma_(a, b, c) vfmaq_f32(c, a, b)
#include "kernels_read.h"

LORA_KERNEL_TABLE(neon, 0u)

#endif /* LORA_HAVE_NEON */
