/*
 * kernels_avx2.c - the AVX2 + FMA path (Haswell and later, Zen).
 *
 * Required features: AVX2, FMA, F16C (isa.c checks all three).
 * Instructions: vfmadd231ps on 8-lane ymm registers; float16 storage is
 * widened with vcvtph2ps (F16C), bfloat16 with vpmovzxwd + vpslld 16 (a
 * bfloat16 is the top half of a float32, so the shift is exact), Q8_0 from
 * its biased bytes with vpmovzxbd + vcvtdq2ps and one vfmsub by its block's
 * scale d and 128 d (exact; see run_f32x8_).
 *
 * Summation order (one per output element, shared by decode, batch, stack
 * and bank):
 *   project     t[k] = ((r_0 + r_1) + r_2) ... + tail, one r_m per column
 *               block m ([m, m+1) x LORA_JBLOCK within cols rounded down to
 *               8; a row of up to 4096 columns is one block), r_m =
 *               hsum8(lanes), lane l = fma-chain from 0 over the block's
 *               j = l (mod 8), ascending;
 *               hsum8 = ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) (the fixed
 *               128-bit-halves, movehl, shuffle tree); tail = fma-chain from
 *               0 over the last cols mod 8 values, ascending.
 *   accumulate  out[i] = out[i] + ((blk_0 + blk_1) + blk_2 ...), blk_m =
 *               fma-chain from 0 over k in [16m, 16m+16) ascending of
 *               M[k,i]*u[k] (LORA_KBLOCK), then out[i] = fma(total, s,
 *               out[i]) (one rounding); vector lanes and the scalar tail
 *               (fmaf, which the FMA target turns into vfmadd) give the same
 *               bits.
 *   by_row      (a term held by output, a caller's lora_B [out, r]) out[i] =
 *               fma(hsum8(lanes) + tail, s, out[i]), lanes and tail as in
 *               project over k (one block whatever the rank), hsum8 the hadd
 *               tree of hsum8x8_.
 * Tail strategy: a short scalar tail (AVX2 has no 16-bit masked loads), the
 * fma chains of kernels_tails.h, shared with the NEON file.
 * Accumulators: project keeps 8 ranks of one position (8 independent ymm
 * chains: FMA latency 4 x 2 ports = 8 in flight) over whole column blocks,
 * or for a batch up to 12 chains of nr ranks x nb positions over 512-column chunks
 * (project_batch_avx2_); accumulate keeps 4 row vectors x 1 or 2 positions = 4
 * or 8 block chains plus their running totals, except a decode (one
 * position), whose two row vectors (one line of M) walk every row of the rank
 * before the next (term_decode_avx2_).  How many ranks or rows share a tile
 * changes no element's order.
 */
#include "kernels.h"

#if defined(LORA_HAVE_X86)
#include <immintrin.h>
#include <math.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define INLINE_ static inline __attribute__((always_inline))

/* The loads and the rounding (narrow_vec_) below know float32, float16 and
 * bfloat16, the last one in each being bfloat16. */
LORA_DTYPES_HANDLED(3, avx2_loads_and_roundings_know_f32_f16_bf16);

INLINE_ __m256 load_f32x8_(const void *p, int64_t i, const int dt) {
    if (dt == LORA_DTYPE_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == LORA_DTYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INLINE_ float load_f32_(const void *p, int64_t i, const int dt) {
    if (dt == LORA_DTYPE_F32) return ((const float *)p)[i];
    if (dt == LORA_DTYPE_F16) return _cvtsh_ss(((const uint16_t *)p)[i]);
    return lora_bf16_to_f32(((const uint16_t *)p)[i]);
}

/* value e of a factor run in storage format f (an element format: its dtype's value; Q8_0:
 * d * q, an 8-bit integer times a float16, exact in float32, so summed in float32's order;
 * q is kept biased, formats.h) */
LORA_FORMATS_HANDLED(4, avx2_run_loads_know_f32_f16_bf16_q8_0);
INLINE_ float run_f32_(lora_run r, int64_t e, const int f) {
    if (f == LORA_FMT_Q8_0)
        return (float)lora_q8_0_q(r.v, e) * _cvtsh_ss(r.d[e >> 5]);
    return load_f32_(r.v, e, f);
}

INLINE_ float hsum_f32x8_(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* One whole vector of the widening and the rounding: dst[i .. i + VEC_LANES_)
 * (the loops and their tails: widen_ and narrow_ in kernels_tails.h) */
#define VEC_LANES_ 8
INLINE_ void widen_vec_(const void *src, int64_t i, float *dst, const int dt) {
    _mm256_storeu_ps(dst + i, load_f32x8_(src, i, dt));
}

/* rounded to nearest even into ot (float16 or bfloat16) */
INLINE_ void narrow_vec_(const float *src, int64_t i, void *dst, const int ot) {
    const __m256 v = _mm256_loadu_ps(src + i);
    __m128i h;
    if (ot == LORA_DTYPE_F16) {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
        const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
        const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
        const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        r = _mm256_blendv_epi8(r, quiet, nan);
        h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), h);
}

#include "kernels_tails.h"

/* A run of a factor's values as float32 (exact): 8 of them, and the table's
 * loader (load_f32_, run_f32_ for one).  The one place this file reads a
 * storage format; an element format is its dtype's values; a Q8_0 value is
 * built from its biased byte b = q + 128 (formats.h): vpmovzxbd, vcvtdq2ps,
 * then one fused multiply-subtract b d - 128 d, which is q d exactly (b d and
 * 128 d are exact in float32, and so is their difference), so a Q8_0 factor
 * is summed in float32's order.  (formats.h's one-shuffle build measured
 * slower here: on 256-bit registers the shuffle and the vpor it needs cost
 * what sign extension and the conversion do.)  Vector runs start at
 * multiples of 8 (rows are multiples of 32 long, tiles and thread splits step
 * by 8), so 8 values never straddle two blocks: one scale a vector. */
/* 128 d, the bias's share of a value (exact: a power of two times a float16) */
INLINE_ __m256 q8_0_d128_f32x8_(__m256 d_f32x8) { return _mm256_mul_ps(d_f32x8, _mm256_set1_ps((float)LORA_Q8_0_BIAS)); }

INLINE_ __m256 q8_0_f32x8_(const uint8_t *q, __m256 d_f32x8, __m256 d128_f32x8) {
    const __m256 b_f32x8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)));
    return _mm256_fmsub_ps(b_f32x8, d_f32x8, d128_f32x8);
}

INLINE_ __m256 run_f32x8_(lora_run r, int64_t e, const int f) {
    if (f == LORA_FMT_Q8_0) {
        const __m256 d_f32x8 = _mm256_cvtph_ps(_mm_set1_epi16((short)r.d[e >> 5]));
        return q8_0_f32x8_((const uint8_t *)r.v + e, d_f32x8, q8_0_d128_f32x8_(d_f32x8));
    }
    return load_f32x8_(r.v, e, f);
}

/* d and 128 d of n consecutive Q8_0 blocks from block b0 (d and d128 hold n rounded up to 8) */
INLINE_ void q8_0_scales_(lora_run r, int64_t b0, int64_t n, float *d, float *d128) {
    int64_t s = 0;
    for (; s + 8 <= n; s += 8) {
        const __m256 d_f32x8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r.d + b0 + s)));
        _mm256_storeu_ps(d + s, d_f32x8);
        _mm256_storeu_ps(d128 + s, q8_0_d128_f32x8_(d_f32x8));
    }
    for (; s < n; s++) d[s] = _cvtsh_ss(r.d[b0 + s]), d128[s] = d[s] * (float)LORA_Q8_0_BIAS;
}

INLINE_ void load_run_(lora_run r, int64_t e, int64_t n, float *dst, const int f) {
    if (lora_format_block(f) == 1) {
        widen_((const char *)r.v + e * (int64_t)lora_format_value_size(f), n, dst, f);
        return;
    }
    int64_t k = 0;
    for (; k < n && (e + k) % 8; k++) dst[k] = run_f32_(r, e + k, f);
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, run_f32x8_(r, e + k, f));
    for (; k < n; k++) dst[k] = run_f32_(r, e + k, f);
}

/* A decode (one position): nr ranks (k .. k+nr) over whole rows, nr <= 8 independent chains
 * (what two FMA ports of latency 4 need in flight) + the x vector + 1 A vector */
INLINE_ void project_rows_avx2_(lora_run a, int64_t lda, int64_t cols, int64_t k, const int nr,
                           const void *x, float *t, const int f, const int xt) {
    float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* the finished column blocks' sums */
    const int64_t body = cols & ~(int64_t)7;
    for (int64_t jb = 0; jb < body; jb += LORA_JBLOCK) {
        const int64_t je = jb + LORA_JBLOCK < body ? jb + LORA_JBLOCK : body;
        __m256 acc_f32x8[8];
        for (int r = 0; r < nr; r++) acc_f32x8[r] = _mm256_setzero_ps();
        /* Q8_0: the rows' d and 128 d over the block, widened once */
        float d_f32[8][LORA_JBLOCK / 32 + 8], d128_f32[8][LORA_JBLOCK / 32 + 8];
        if (f == LORA_FMT_Q8_0)
            for (int r = 0; r < nr; r++)
                q8_0_scales_(a, ((k + r) * lda + jb) / 32, (je - jb + 31) / 32, d_f32[r], d128_f32[r]);
        for (int64_t j = jb; j < je; j += 8) {
            const __m256 x_f32x8 = load_f32x8_(x, j, xt);
            for (int r = 0; r < nr; r++) {
                const int64_t e = (k + r) * lda + j;
                const __m256 a_f32x8 =
                    f == LORA_FMT_Q8_0
                        ? q8_0_f32x8_((const uint8_t *)a.v + e, _mm256_broadcast_ss(&d_f32[r][(j - jb) >> 5]),
                                      _mm256_broadcast_ss(&d128_f32[r][(j - jb) >> 5]))
                        : run_f32x8_(a, e, f);
                acc_f32x8[r] = _mm256_fmadd_ps(a_f32x8, x_f32x8, acc_f32x8[r]);
            }
        }
        for (int r = 0; r < nr; r++) {
            const float block = hsum_f32x8_(acc_f32x8[r]);
            sum[r] = jb == 0 ? block : sum[r] + block;
        }
    }
    for (int r = 0; r < nr; r++) {
        const float tail = fma_tail_(a, (k + r) * lda + body, f, x, body, xt, cols - body);
        t[k + r] = sum[r] + tail;
    }
}

/* ranks [k0, k1) of one position: tiles of 8 ranks, then one rank at a time */
INLINE_ void project_decode_avx2_(lora_run a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                             const void *x, float *t, const int f, const int xt) {
    int64_t k = k0;
    for (; k + 8 <= k1; k += 8) project_rows_avx2_(a, lda, cols, k, 8, x, t, f, xt);
    for (; k < k1; k++) project_rows_avx2_(a, lda, cols, k, 1, x, t, f, xt);
}

/* A batch (nb >= 2 positions) walks the columns in chunks of CHUNK_, and
 * within a chunk every tile of nr ranks x nb positions reads the same nb
 * x-chunks, which stay in L1 (4 x 2 KiB) while A comes from L2 once per
 * block of positions, each A load feeding all nb of them.  Tiles keep
 * nr * nb <= 12 chains in registers (3 ranks x 4 positions with the 3 A
 * vectors held and one x at a time; 4 x 3 and 6 x 2 with the x vectors held
 * and one A at a time: <= 16 ymm), then tiles of 2 and 1 rank for the rest;
 * between chunks a tile's lanes live in `state`.  Chunk edges are multiples
 * of 8, so each lane still sums its j = l (mod 8) terms in ascending j: the
 * header's order, whatever the tile. */
#define CHUNK_ 512
#define KGROUP_ 24

/* nr ranks (k .. k+nr) x nb positions over columns [j0, j1) (whole vectors);
 * the chains in state[r * nb + b] */
INLINE_ void project_chunk_avx2_(lora_run a, int64_t lda, int64_t k, int64_t j0, int64_t j1,
                            const int nr, const int nb, const void *const *xs, __m256 *state,
                            const int f, const int xt) {
    __m256 acc_f32x8[12];
    for (int i = 0; i < nr * nb; i++) acc_f32x8[i] = state[i];
    for (int64_t j = j0; j < j1; j += 8) {
        if (nb == 4) {  /* the nr A vectors in registers, one x at a time */
            __m256 a_f32x8[3];
            for (int r = 0; r < nr; r++) a_f32x8[r] = run_f32x8_(a, (k + r) * lda + j, f);
            for (int b = 0; b < nb; b++) {
                const __m256 x_f32x8 = load_f32x8_(xs[b], j, xt);
                for (int r = 0; r < nr; r++)
                    acc_f32x8[r * nb + b] = _mm256_fmadd_ps(a_f32x8[r], x_f32x8, acc_f32x8[r * nb + b]);
            }
        } else {  /* the nb x vectors in registers, one A row at a time */
            __m256 x_f32x8[3];
            for (int b = 0; b < nb; b++) x_f32x8[b] = load_f32x8_(xs[b], j, xt);
            for (int r = 0; r < nr; r++) {
                const __m256 a_f32x8 = run_f32x8_(a, (k + r) * lda + j, f);
                for (int b = 0; b < nb; b++)
                    acc_f32x8[r * nb + b] = _mm256_fmadd_ps(a_f32x8, x_f32x8[b], acc_f32x8[r * nb + b]);
            }
        }
    }
    for (int i = 0; i < nr * nb; i++) state[i] = acc_f32x8[i];
}

/* ranks kg .. kg+kn over the whole-vector columns [j0, j1), in chunks of CHUNK_.  Called from
 * one place only: a second inlined copy (a separate loop for one-block rows) made GCC keep the
 * tile's chains in memory, 10 % more instructions on a 512-position prefill (callgrind) */
INLINE_ void project_span_avx2_(lora_run a, int64_t lda, int64_t kg, int kn, int64_t j0, int64_t j1,
                           const int nr, const int nb, const void *const *xs, __m256 *state,
                           const int f, const int xt) {
    for (int64_t c0 = j0; c0 < j1; c0 += CHUNK_) {
        const int64_t c1 = c0 + CHUNK_ < j1 ? c0 + CHUNK_ : j1;
        int k = 0;
        for (; k + nr <= kn; k += nr)
            project_chunk_avx2_(a, lda, kg + k, c0, c1, nr, nb, xs, state + k * nb, f, xt);
        for (; k + 2 <= kn; k += 2)
            project_chunk_avx2_(a, lda, kg + k, c0, c1, 2, nb, xs, state + k * nb, f, xt);
        for (; k < kn; k++) project_chunk_avx2_(a, lda, kg + k, c0, c1, 1, nb, xs, state + k * nb, f, xt);
    }
}

INLINE_ void project_batch_avx2_(lora_run a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                            const int nb, const void *const *xs, float *t, int64_t ldt,
                            const int f, const int xt) {
    const int nr = nb == 2 ? 6 : nb == 3 ? 4 : 3;
    const int64_t body = cols & ~(int64_t)7;
    __m256 state[KGROUP_ * LORA_NB]; /* the current column block's chains */
    for (int64_t kg = k0; kg < k1; kg += KGROUP_) {
        const int kn = (int)(k1 - kg < KGROUP_ ? k1 - kg : KGROUP_);
        for (int i = 0; i < kn * nb; i++) state[i] = _mm256_setzero_ps();
        int blocks = 0; /* column blocks (LORA_JBLOCK) finished: their sums are in t */
        for (int64_t jb = 0; jb < body; jb += LORA_JBLOCK) { /* one call site: see above */
            const int64_t je = jb + LORA_JBLOCK < body ? jb + LORA_JBLOCK : body;
            project_span_avx2_(a, lda, kg, kn, jb, je, nr, nb, xs, state, f, xt);
            if (je < body) { /* a block ends and another follows: its sum joins t */
                for (int k = 0; k < kn; k++)
                    for (int b = 0; b < nb; b++) {
                        float *tk = &t[b * ldt + kg + k];
                        const float sum = hsum_f32x8_(state[k * nb + b]);
                        *tk = blocks ? *tk + sum : sum;
                        state[k * nb + b] = _mm256_setzero_ps();
                    }
                blocks++;
            }
        }
        for (int k = 0; k < kn; k++)
            for (int b = 0; b < nb; b++) {
                const float tail = fma_tail_(a, (kg + k) * lda + body, f, xs[b], body, xt, cols - body);
                const float sum = hsum_f32x8_(state[k * nb + b]);
                t[b * ldt + kg + k] = (blocks ? t[b * ldt + kg + k] + sum : sum) + tail;
            }
    }
}

INLINE_ void project_(lora_run a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                      int nb, const void *const *xs, float *t, int64_t ldt, const int f,
                      const int xt) {
    switch (nb) {  /* a constant nb keeps every chain of a tile in a register */
    case 1: project_decode_avx2_(a, lda, cols, k0, k1, xs[0], t, f, xt); break;
    case 2: project_batch_avx2_(a, lda, cols, k0, k1, 2, xs, t, ldt, f, xt); break;
    case 3: project_batch_avx2_(a, lda, cols, k0, k1, 3, xs, t, ldt, f, xt); break;
    default: project_batch_avx2_(a, lda, cols, k0, k1, 4, xs, t, ldt, f, xt); break;
    }
}

/* outputs i .. i + 8*nv of nb positions, nv * nb <= 8 block chains (8 in flight for two
 * FMA ports of latency 4; an M load serves nb positions), their running totals (touched
 * once per LORA_KBLOCK FMAs, so a spill of them is cheap) and the operands */
INLINE_ void term_tile_avx2_(lora_run m, int64_t ldm, int64_t kdim, int64_t i, const int nv,
                        const int nb, const float *u, int64_t ldu, const float *scale,
                        float *const *outs, int64_t obase, const int f) {
    __m256 total_f32x8[4][LORA_NB] = {{_mm256_setzero_ps()}}, block_f32x8[4][LORA_NB];
    for (int64_t k0 = 0; k0 < kdim; k0 += LORA_KBLOCK) {
        const int64_t k1 = k0 + LORA_KBLOCK < kdim ? k0 + LORA_KBLOCK : kdim;
        for (int v = 0; v < nv; v++)
            for (int b = 0; b < nb; b++) block_f32x8[v][b] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            __m256 m_f32x8[4];
            for (int v = 0; v < nv; v++) m_f32x8[v] = run_f32x8_(m, k * ldm + i + 8 * v, f);
            for (int b = 0; b < nb; b++) {
                const __m256 u_f32x8 = _mm256_broadcast_ss(u + b * ldu + k);
                for (int v = 0; v < nv; v++)
                    block_f32x8[v][b] = _mm256_fmadd_ps(m_f32x8[v], u_f32x8, block_f32x8[v][b]);
            }
        }
        for (int v = 0; v < nv; v++)
            for (int b = 0; b < nb; b++)
                total_f32x8[v][b] = k0 == 0 ? block_f32x8[v][b]
                                            : _mm256_add_ps(total_f32x8[v][b], block_f32x8[v][b]);
    }
    for (int b = 0; b < nb; b++) {
        if (scale[b] == 0.0f) continue;
        for (int v = 0; v < nv; v++) {
            float *o = outs[b] + (i - obase) + 8 * v;
            _mm256_storeu_ps(o, _mm256_fmadd_ps(total_f32x8[v][b], _mm256_set1_ps(scale[b]),
                                                _mm256_loadu_ps(o)));
        }
    }
}

/* A decode's outputs i .. i + 8 nv (nv = 1 or 2: one 64-byte line of a
 * float32 M row; 4 for a Q8_0 block), their whole chain over the rank before the next: the
 * blocked chains of term_tile_avx2_ (kn a constant where it can be, see
 * term_decode_avx2_), the totals in registers, then out = fma(total, s, out). */
INLINE_ void term_vecs_avx2_(lora_run m, int64_t ldm, int64_t kdim, const int kn, int64_t i,
                          const int nv, const float *u, float s, float *out, int64_t obase,
                          const int f) {
    __m256 total_f32x8[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k0 = 0; k0 < kdim; k0 += LORA_KBLOCK) {
        const int n = kn ? kn : (int)(kdim - k0 < LORA_KBLOCK ? kdim - k0 : LORA_KBLOCK);
        __m256 block_f32x8[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int k = 0; k < n; k++) {
            const __m256 u_f32x8 = _mm256_broadcast_ss(u + k0 + k);
            if (f == LORA_FMT_Q8_0) { /* the nv vectors share a block (the caller sees to it) */
                const int64_t e = (k0 + k) * ldm + i;
                const __m256 d_f32x8 = _mm256_set1_ps(_cvtsh_ss(m.d[e >> 5]));
                const __m256 d128_f32x8 = q8_0_d128_f32x8_(d_f32x8);
                for (int v = 0; v < nv; v++)
                    block_f32x8[v] = _mm256_fmadd_ps(q8_0_f32x8_((const uint8_t *)m.v + e + 8 * v, d_f32x8, d128_f32x8),
                                                     u_f32x8, block_f32x8[v]);
                continue;
            }
            for (int v = 0; v < nv; v++)
                block_f32x8[v] = _mm256_fmadd_ps(run_f32x8_(m, (k0 + k) * ldm + i + 8 * v, f), u_f32x8,
                                                 block_f32x8[v]);
        }
        for (int v = 0; v < nv; v++)
            total_f32x8[v] = k0 == 0 ? block_f32x8[v] : _mm256_add_ps(total_f32x8[v], block_f32x8[v]);
    }
    for (int v = 0; v < nv; v++) {
        float *o = out + (i - obase) + 8 * v;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(total_f32x8[v], _mm256_set1_ps(s), _mm256_loadu_ps(o)));
    }
}

/* One term of a decode (one position) over outputs [i0, i1), output i at
 * out[i - obase].  term_tile_avx2_'s tiles ask for 128 bytes of one M row after
 * another; here every 16 outputs walk all the rows, one line of each, in
 * order, which reads faster where the factors come from memory, as in a
 * model's decode step (the AVX-512 file's term_decode_avx512_; docs/performance.md,
 * "The decode accumulate").  A rank of 16 (or 8) is one block of a constant
 * length, so each M load is its own instruction stepping one line at a time.
 * The arithmetic is term_tile_avx2_'s; the last outputs, term_lanes_'s. */
INLINE_ void term_decode_avx2_(lora_run m, int64_t ldm, int64_t kdim, int64_t i0, int64_t i1,
                          const float *u, const float *scale, float *const *outs, int64_t obase,
                          const int f) {
    const float s = scale[0];
    if (s == 0.0f) return; /* as term_tile_avx2_: a zero scale writes nothing */
    float *out = outs[0];
    int64_t i = i0;
    if (f == LORA_FMT_Q8_0) {
        /* a whole block of 32 outputs a call, so its d and 128 d are broadcast once for four
         * vectors (each output's chain is the same); a first 16 outputs that end a block go
         * alone */
        if ((i & 31) && i + 16 <= i1) {
            term_vecs_avx2_(m, ldm, kdim, 0, i, 2, u, s, out, obase, f);
            i += 16;
        }
        if (kdim == 16) {
            for (; i + 32 <= i1; i += 32) term_vecs_avx2_(m, ldm, 16, 16, i, 4, u, s, out, obase, f);
        } else {
            for (; i + 32 <= i1; i += 32) term_vecs_avx2_(m, ldm, kdim, 0, i, 4, u, s, out, obase, f);
        }
    }
    if (kdim == 16) {
        for (; i + 16 <= i1; i += 16) term_vecs_avx2_(m, ldm, 16, 16, i, 2, u, s, out, obase, f);
    } else if (kdim == 8) {
        for (; i + 16 <= i1; i += 16) term_vecs_avx2_(m, ldm, 8, 8, i, 2, u, s, out, obase, f);
    } else {
        for (; i + 16 <= i1; i += 16) term_vecs_avx2_(m, ldm, kdim, 0, i, 2, u, s, out, obase, f);
    }
    for (; i + 8 <= i1; i += 8) term_vecs_avx2_(m, ldm, kdim, 0, i, 1, u, s, out, obase, f);
    term_lanes_(m, ldm, kdim, i, i1, 1, u, 1, scale, outs, obase, f);
}

/* one term over outputs [i0, i1) of nb positions; output i lives at
 * outs[b][i - obase] */
INLINE_ void term_nb_(lora_run m, int64_t ldm, int64_t kdim, int64_t i0, int64_t i1,
                      const int nb, const float *u, int64_t ldu, const float *scale,
                      float *const *outs, int64_t obase, const int f) {
    if (nb == 1) {
        term_decode_avx2_(m, ldm, kdim, i0, i1, u, scale, outs, obase, f);
        return;
    }
    const int nv = nb <= 2 ? 4 : 2;
    int64_t i = i0;
    for (; i + 8 * nv <= i1; i += 8 * nv)
        term_tile_avx2_(m, ldm, kdim, i, nv, nb, u, ldu, scale, outs, obase, f);
    for (; i + 8 <= i1; i += 8) term_tile_avx2_(m, ldm, kdim, i, 1, nb, u, ldu, scale, outs, obase, f);
    /* the same blocked chains, one lane at a time */
    term_lanes_(m, ldm, kdim, i, i1, nb, u, ldu, scale, outs, obase, f);
}

#include "kernels_quads.h"

/* [hsum(v0), ..., hsum(v7)]: the fixed hadd / 128-bit-halves tree, so lane l is
 * ((v_l[0]+v_l[1])+(v_l[2]+v_l[3])) + ((v_l[4]+v_l[5])+(v_l[6]+v_l[7])) */
INLINE_ __m256 hsum8x8_(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* A term held by output (by_row): out[i] += s * dot(M^T[i, :], u) for i in [i0, i1), 8
 * rows at a time; each row's dot product is the project order (lanes k mod 8, hsum8, then
 * the scalar tail), so a row's bits do not depend on which 8 rows share its tile. */
INLINE_ void term_rows_(const lora_term *tm, int64_t i0, int64_t i1, int nb, float *const *outs,
                        int64_t obase, const int f) {
    const int64_t kdim = tm->kdim, ldm = tm->ldm, body = kdim & ~(int64_t)7;
    for (int b = 0; b < nb; b++) {
        const float s = tm->scale[b];
        if (s == 0.0f) continue;
        const float *u = tm->u + b * tm->ldu;
        for (int64_t i = i0; i < i1; i += 8) {
            const int nrows = (int)(i1 - i < 8 ? i1 - i : 8);
            __m256 acc_f32x8[8];
            float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int l = 0; l < 8; l++) {
                __m256 a = _mm256_setzero_ps();
                if (l < nrows) {
                    const int64_t row = (i + l) * ldm;
                    for (int64_t k = 0; k < body; k += 8)
                        a = _mm256_fmadd_ps(run_f32x8_(tm->m, row + k, f), _mm256_loadu_ps(u + k), a);
                    tail[l] = fma_tail_(tm->m, row + body, f, u, body, LORA_DTYPE_F32,
                                        kdim - body);
                }
                acc_f32x8[l] = a;
            }
            const __m256 sum = _mm256_add_ps(hsum8x8_(acc_f32x8), _mm256_loadu_ps(tail));
            float *o = outs[b] + (i - obase);
            if (nrows == 8) {
                _mm256_storeu_ps(o, _mm256_fmadd_ps(sum, _mm256_set1_ps(s), _mm256_loadu_ps(o)));
            } else {
                float lane[8];
                _mm256_storeu_ps(lane, sum);
                for (int l = 0; l < nrows; l++) o[l] = fmaf(lane[l], s, o[l]);
            }
        }
    }
}

#include "kernels_strip.h"
#include "kernels_merge.h"

#define READ_F32V_ __m256
#define READ_LANES_ 8
#define read_zero_() _mm256_setzero_ps()
#define read_load_(p) _mm256_loadu_ps(p)
#define read_add_(a, b) _mm256_add_ps(a, b)
#define read_hsum_(v) hsum_f32x8_(v)
#define read_set1_(f) _mm256_set1_ps(f)
#define read_fma_(a, b, c) _mm256_fmadd_ps(a, b, c)
#include "kernels_read.h"

LORA_KERNEL_TABLE(avx2, 0u)

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif /* LORA_HAVE_X86 */
