/*
 * q8_0_widen.c - how fast one core builds q8_0 values in the decode's B loop, per way of
 * building them, against bfloat16 (docs/performance.md, "Building Q8_0 values").
 *
 * The loop is the AVX-512 decode accumulate's: 16 rank rows of N outputs, each vector of 16
 * outputs an fma chain over the rows; `w` vectors (chains) a step.  Every q8_0 way must give
 * the float32 loop's bits on the dequantized values (checked first).  One thread, best of 30
 * windows; N = 512 keeps the rows in L1, N = 4096 in L2.
 *
 *   gcc -O3 -mavx512f -mavx512bw -mavx512vl -mfma -mf16c -o /tmp/q8w benchmarks/q8_0_widen.c -lm
 * (add -mavx512vbmi for the vpermt2b way, on a core that has VBMI)
 *   /tmp/q8w 4096
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define K 16
#define NMAX 16384
static uint8_t q[K][NMAX] __attribute__((aligned(64)));      /* biased bytes b = q + 128 */
static uint16_t bf[K][NMAX] __attribute__((aligned(64)));    /* bfloat16 values */
static float fq[K][NMAX] __attribute__((aligned(64)));       /* the dequantized values */
static float d[K][NMAX / 32], big[K][NMAX / 32], off[K][NMAX / 32];
static float out[NMAX] __attribute__((aligned(64)));
static float u[K];
static int N = 4096;

/* shuffle: the byte into bits 8..15 of 1.0f (1 + b 2^-15), then fmsub by D = d 2^15, C = D + D 2^-8 */
static inline __m512 shuffle_(const uint8_t *p, int k, int blk) {
    const __m512i idx = _mm512_set_epi32(0x0f00, 0x0e00, 0x0d00, 0x0c00, 0x0b00, 0x0a00, 0x0900, 0x0800,
                                         0x0700, 0x0600, 0x0500, 0x0400, 0x0300, 0x0200, 0x0100, 0x0000);
    const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
    const __m512 v = _mm512_castsi512_ps(
        _mm512_mask_shuffle_epi8(_mm512_set1_epi32(0x3f800000), (__mmask64)0x2222222222222222ull, raw, idx));
    return _mm512_fmsub_ps(v, _mm512_set1_ps(big[k][blk]), _mm512_set1_ps(off[k][blk]));
}
/* cvt: sign extension of q = b ^ 0x80, int-to-float, times d */
static inline __m512 cvt_(const uint8_t *p, int k, int blk) {
    const __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)0x80));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(d[k][blk]));
}

/* Exact ways with other ops (docs/performance.md, "Other exact builds").  Each block's float16
 * scale as d = m 2^e, m a signed integer of up to 11 bits (mw: m in the low 16 bits of a lane) */
static int32_t mw[K][NMAX / 32], mb[K][NMAX / 32];
static float mf[K][NMAX / 32], ue[K][NMAX / 32], big8[K][NMAX / 32], off8[K][NMAX / 32];
/* magic: b m exactly by vpmaddwd, added into the bits of M = 1.5 2^(23+e) less 128 m (mb: the
 * bias), then M subtracted (exact): d q with no multiply on the FMA pipes */
static inline __m512 magic_(const uint8_t *p, int k, int blk) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i n = _mm512_add_epi32(_mm512_madd_epi16(b, _mm512_set1_epi32(mw[k][blk])),
                                       _mm512_set1_epi32(mb[k][blk]));
    return _mm512_sub_ps(_mm512_castsi512_ps(n), _mm512_set1_ps(mf[k][blk]));
}
/* imul: q m exactly by vpmaddwd, int-to-float, and the scale's 2^e moved into u (ue = u 2^e,
 * exact while it stays a normal float32: here u >= 0.01), so the FMA's product is d q u
 * itself: the multiply on the integer pipes.  ue is made outside the timed loop; a kernel
 * would make it per row and block each call. */
static inline __m512 imul_(const uint8_t *p, int k, int blk) {
    const __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)0x80));
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_cvtepi8_epi32(b), _mm512_set1_epi32(mw[k][blk])));
}
/* zx15: zero extension, the byte into bits 15..22 of 1.0f (1 + b/256) by a shift and an or,
 * then fmsub by 256 d and 384 d: shuffle's arithmetic without the byte shuffle */
static inline __m512 zx15_(const uint8_t *p, int k, int blk) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512 v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(b, 15), _mm512_set1_epi32(0x3f800000)));
    return _mm512_fmsub_ps(v, _mm512_set1_ps(big8[k][blk]), _mm512_set1_ps(off8[k][blk]));
}
#ifdef __AVX512VBMI__
/* perm2: one vpermt2b takes the byte and the bits of 1.0f from two registers (no merge mask),
 * then shuffle's fmsub (build with -mavx512vbmi) */
static inline __m512 perm2_(const uint8_t *p, int k, int blk) {
    const __m512i idx = _mm512_set_epi32(0x43420f40, 0x43420e40, 0x43420d40, 0x43420c40, 0x43420b40, 0x43420a40,
                                         0x43420940, 0x43420840, 0x43420740, 0x43420640, 0x43420540, 0x43420440,
                                         0x43420340, 0x43420240, 0x43420140, 0x43420040);
    const __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
    const __m512 v = _mm512_castsi512_ps(_mm512_permutex2var_epi8(raw, idx, _mm512_set1_epi32(0x3f800000)));
    return _mm512_fmsub_ps(v, _mm512_set1_ps(big[k][blk]), _mm512_set1_ps(off[k][blk]));
}
#endif
/* not a way (its values are q, not d q): cvt without its multiply, what that multiply costs */
static inline __m512 nomul_(const uint8_t *p, int k, int blk) {
    (void)k, (void)blk;
    const __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)0x80));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

static inline __m512 f32_(const uint8_t *p, int k, int blk) {
    (void)blk;
    return _mm512_loadu_ps(&fq[k][p - q[k]]);
}

#define LOOP(NAME, BUILD, W)                                                                     \
    static __attribute__((noinline)) void NAME(void) {                                           \
        for (int i = 0; i < N; i += 16 * W) {                                                    \
            __m512 acc[W];                                                                       \
            for (int w = 0; w < W; w++) acc[w] = _mm512_setzero_ps();                            \
            for (int k = 0; k < K; k++)                                                          \
                for (int w = 0; w < W; w++)                                                      \
                    acc[w] = _mm512_fmadd_ps(BUILD(&q[k][i + 16 * w], k, (i + 16 * w) >> 5),     \
                                             _mm512_set1_ps(u[k]), acc[w]);                      \
            for (int w = 0; w < W; w++)                                                          \
                _mm512_storeu_ps(out + i + 16 * w, _mm512_add_ps(_mm512_loadu_ps(out + i + 16 * w), acc[w])); \
        }                                                                                        \
    }
LOOP(f32_w2, f32_, 2) LOOP(shuffle_w2, shuffle_, 2) LOOP(shuffle_w4, shuffle_, 4)
LOOP(cvt_w2, cvt_, 2) LOOP(cvt_w4, cvt_, 4)
LOOP(magic_w4, magic_, 4) LOOP(zx15_w4, zx15_, 4) LOOP(nomul_w4, nomul_, 4)
#ifdef __AVX512VBMI__
LOOP(perm2_w4, perm2_, 4)
#endif
/* imul: the loop with the FMA's other operand u 2^e, one per row and block */
static __attribute__((noinline)) void imul_w4(void) {
    for (int i = 0; i < N; i += 64) {
        __m512 acc[4];
        for (int w = 0; w < 4; w++) acc[w] = _mm512_setzero_ps();
        for (int k = 0; k < K; k++)
            for (int w = 0; w < 4; w++) {
                const int blk = (i + 16 * w) >> 5;
                acc[w] = _mm512_fmadd_ps(imul_(&q[k][i + 16 * w], k, blk), _mm512_set1_ps(ue[k][blk]), acc[w]);
            }
        for (int w = 0; w < 4; w++)
            _mm512_storeu_ps(out + i + 16 * w, _mm512_add_ps(_mm512_loadu_ps(out + i + 16 * w), acc[w]));
    }
}

/* bfloat16 as the library's decode reads it: 32 values a load, even and odd lanes by vpshufb */
static __attribute__((noinline)) void bf16_w2(void) {
    const __m512i ie = _mm512_broadcast_i32x4(_mm_setr_epi32(0x0100ffff, 0x0504ffff, 0x0908ffff, 0x0d0cffff));
    const __m512i io = _mm512_broadcast_i32x4(_mm_setr_epi32(0x0302ffff, 0x0706ffff, 0x0b0affff, 0x0f0effff));
    for (int i = 0; i < N; i += 32) {
        __m512 e = _mm512_setzero_ps(), o = e;
        for (int k = 0; k < K; k++) {
            const __m512i r = _mm512_loadu_si512(&bf[k][i]);
            e = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_shuffle_epi8(r, ie)), _mm512_set1_ps(u[k]), e);
            o = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_shuffle_epi8(r, io)), _mm512_set1_ps(u[k]), o);
        }
        _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_loadu_ps(out + i), e));
        _mm512_storeu_ps(out + i + 16, _mm512_add_ps(_mm512_loadu_ps(out + i + 16), o));
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc > 1) N = atoi(argv[1]);
    if (N < 64 || N > NMAX || N % 64) {
        fprintf(stderr, "N: a multiple of 64 in [64, %d]\n", NMAX);
        return 2;
    }
    srand(1);
    for (int k = 0; k < K; k++) {
        u[k] = 0.01f * (k + 1);
        for (int b = 0; b < N / 32; b++) { /* float16 scales, some subnormal-small, both signs */
            const float x = 0.001f * (1 + rand() % 100) * (rand() & 1 ? 1 : -1) * (rand() % 4 ? 1.f : 1e-3f);
            d[k][b] = _cvtsh_ss(_cvtss_sh(x, 0));
            big[k][b] = d[k][b] * 32768.0f;
            off[k][b] = big[k][b] + big[k][b] / 256.0f;
            big8[k][b] = 256.0f * d[k][b];
            off8[k][b] = 384.0f * d[k][b];
            int e; /* d = m 2^e: frexp's d = f 2^e' with |f| in [0.5, 1), m = f 2^11, e = e' - 11 */
            const int m = (int)ldexpf(frexpf(d[k][b], &e), 11);
            e -= 11;
            mw[k][b] = m & 0xffff;
            ue[k][b] = ldexpf(u[k], e);
            mf[k][b] = ldexpf(1.5f, 23 + e);
            int32_t bits;
            memcpy(&bits, &mf[k][b], sizeof bits);
            mb[k][b] = bits - 128 * m;
        }
        for (int i = 0; i < N; i++) {
            q[k][i] = (uint8_t)rand();
            fq[k][i] = (float)((int)q[k][i] - 128) * d[k][i / 32];
            bf[k][i] = (uint16_t)(0x3f80 + (rand() & 0x7f));
        }
    }
    struct { const char *name; void (*fn)(void); int exact; } ways[] = {
        {"float32 (the dequantized values), 2 chains", f32_w2, 0},
        {"bfloat16, 2 chains (even/odd)", bf16_w2, -1},
        {"q8_0 shuffle, 2 chains", shuffle_w2, 1}, {"q8_0 shuffle, 4 chains", shuffle_w4, 1},
        {"q8_0 cvt, 2 chains", cvt_w2, 1}, {"q8_0 cvt, 4 chains", cvt_w4, 1},
        {"q8_0 magic (integer add), 4 chains", magic_w4, 1}, {"q8_0 imul (vpmaddwd), 4 chains", imul_w4, 1},
        {"q8_0 zx15 (shift and or), 4 chains", zx15_w4, 1},
#ifdef __AVX512VBMI__
        {"q8_0 perm2 (vpermt2b), 4 chains", perm2_w4, 1},
#endif
        {"cvt without the multiply (not d q)", nomul_w4, 0},
    };
    const int n_ways = (int)(sizeof ways / sizeof ways[0]);
    static float want[NMAX];
    memset(out, 0, sizeof out);
    f32_w2();
    memcpy(want, out, sizeof want);
    for (int w = 0; w < n_ways; w++) {
        if (ways[w].exact != 1) continue;
        memset(out, 0, sizeof out);
        ways[w].fn();
        if (memcmp(out, want, (size_t)N * sizeof(float))) {
            printf("%s: NOT the float32 loop's bits\n", ways[w].name);
            return 1;
        }
    }
    printf("%d rank rows x %d outputs (%d KiB of q8_0 values); every q8_0 way gives the float32 bits\n",
           K, N, K * N / 1024);
    for (int w = 0; w < n_ways; w++) {
        double best = 1e9;
        for (int t = 0; t < 30; t++) {
            const double t0 = now();
            for (int r = 0; r < 100; r++) ways[w].fn();
            const double dt = (now() - t0) / 100;
            if (dt < best) best = dt;
        }
        printf("  %-44s %8.2f us  %.3f ns a vector of 16\n", ways[w].name, best * 1e6, best * 1e9 / (N * K / 16));
    }
    return 0;
}
