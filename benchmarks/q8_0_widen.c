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
