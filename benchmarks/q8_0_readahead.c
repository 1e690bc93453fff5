/*
 * q8_0_readahead.c - whether one core overlaps a q8_0 decode's reads from memory with its
 * arithmetic, and whether asking for the next delta while the current one computes makes it
 * (docs/performance.md, "Reading ahead, measured").
 *
 * A "delta" here is two factors of 16 rows x 4096 one-byte values (128 KiB), each walked as the
 * AVX-512 decode accumulate walks a q8_0 B (a vector of 16 outputs through every row, four
 * chains, int8 values sign-extended, converted and multiplied by a scale).  Enough deltas to
 * fill four times the last-level cache (sysfs; 256 MiB when it says nothing) are walked one after
 * another, so each comes from memory (cold), against the same count of walks over one delta that
 * stays in cache (warm) and a plain read of every delta's bytes with no arithmetic (read).  If the
 * core overlapped the reads with the arithmetic, cold would approach the larger of warm and read;
 * with no overlap it is their sum.  The ways of reading ahead:
 *
 *   next, bursts     before each strip of 256 outputs, a 1/32 share of the next delta's lines
 *   next, paced      one line of the next delta for every line the current one reads
 *   scales           the scales from their own array, one float16 per 32 values (as the
 *                    library stores them), read when a strip starts
 *   scales, ahead    the same, each row's next strip's scale line asked for a strip ahead
 *
 *   gcc -O3 -mavx512f -mavx512bw -mavx512vl -mfma -mf16c -o /tmp/q8ra benchmarks/q8_0_readahead.c
 *   /tmp/q8ra [MiB of deltas, 4x the last-level cache unless given]
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define K 16                   /* rank rows */
#define NOUT 4096              /* values a row */
#define FACTOR (K * NOUT)      /* bytes of one factor */
#define DELTA (2 * FACTOR)     /* bytes of one delta */
#define STRIP 256              /* outputs a strip */
#define STRIPS (2 * NOUT / STRIP)
#define SCALES (DELTA / 32)    /* float16 scales of one delta */

static float u[K], out[NOUT] __attribute__((aligned(64)));
static uint8_t *values;
static uint16_t *scales;
static size_t n_deltas;

enum { WARM, COLD, BURSTS, PACED, SCALED, SCALED_AHEAD, READ, N_WAYS };
static const char *names[N_WAYS] = {"warm (one delta, in cache)", "cold", "cold, next delta in bursts",
                                    "cold, next delta paced", "cold, scales from their array",
                                    "cold, scales asked a strip ahead", "read only (no arithmetic)"};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static inline __m512 values_(const uint8_t *p, __m512 d) {
    const __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)0x80));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d);
}

/* one factor m (its scales s, or NULL for one fixed scale); way BURSTS / PACED ask for the
 * next delta's lines from *ahead on */
static void factor_(const uint8_t *m, const uint16_t *s, const uint8_t *next, size_t *ahead, int way) {
    for (int s0 = 0; s0 < NOUT; s0 += STRIP) {
        float d[K][STRIP / 32];
        for (int k = 0; k < K; k++)
            for (int b = 0; b < STRIP / 32; b++) d[k][b] = s ? _cvtsh_ss(s[(k * NOUT + s0) / 32 + b]) : 0.01f;
        if (way == SCALED_AHEAD && s0 + STRIP < NOUT)
            for (int k = 0; k < K; k++) _mm_prefetch((const char *)(s + (k * NOUT + s0 + STRIP) / 32), _MM_HINT_T0);
        if (way == BURSTS)
            for (size_t l = 0; l < DELTA / 64 / STRIPS; l++, *ahead += 64)
                _mm_prefetch((const char *)next + *ahead, _MM_HINT_T0);
        for (int i = s0; i < s0 + STRIP; i += 64) {
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int k = 0; k < K; k++) {
                const uint8_t *q = m + k * NOUT + i;
                if (way == PACED) {
                    _mm_prefetch((const char *)next + *ahead, _MM_HINT_T0);
                    *ahead += 64;
                }
                const __m512 uk = _mm512_set1_ps(u[k]);
                const int b = (i - s0) / 32;
                for (int v = 0; v < 4; v++)
                    acc[v] = _mm512_fmadd_ps(values_(q + 16 * v, _mm512_set1_ps(d[k][b + v / 2])), uk, acc[v]);
            }
            for (int v = 0; v < 4; v++)
                _mm512_storeu_ps(out + i + 16 * v, _mm512_add_ps(_mm512_loadu_ps(out + i + 16 * v), acc[v]));
        }
    }
}

static double pass_(int way) {
    static uint8_t spare[DELTA] __attribute__((aligned(64))); /* where the last delta reads ahead */
    unsigned sink = 0;
    const double t0 = now();
    for (size_t i = 0; i < n_deltas; i++) {
        const size_t at = way == WARM ? 0 : i;
        const uint8_t *m = values + at * DELTA;
        const uint16_t *s = way == SCALED || way == SCALED_AHEAD ? scales + at * SCALES : NULL;
        if (way == READ) {
            __m512i acc = _mm512_setzero_si512();
            for (size_t o = 0; o < DELTA; o += 64) acc = _mm512_xor_si512(acc, _mm512_load_si512(m + o));
            sink ^= (unsigned)_mm512_reduce_or_epi32(acc);
            continue;
        }
        const uint8_t *next = i + 1 < n_deltas ? values + (i + 1) * DELTA : spare;
        size_t ahead = 0;
        factor_(m, s, next, &ahead, way);
        factor_(m + FACTOR, s ? s + SCALES / 2 : NULL, next, &ahead, way);
    }
    out[0] += (float)(sink & 1);
    return (now() - t0) / (double)n_deltas;
}

static size_t llc_bytes_(void) {
    size_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], text[32];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        if (fgets(text, sizeof text, f)) {
            char *end;
            size_t n = strtoul(text, &end, 10);
            n <<= *end == 'M' ? 20 : *end == 'K' ? 10 : 0;
            if (n > best) best = n;
        }
        fclose(f);
    }
    return best;
}

int main(int argc, char **argv) {
    const size_t llc = llc_bytes_();
    size_t bytes = llc ? 4 * llc : (size_t)256 << 20;
    if (argc > 1) bytes = (size_t)strtoul(argv[1], NULL, 10) << 20; /* MiB (a smoke run) */
    if (bytes < DELTA) {
        fprintf(stderr, "at least %d KiB of deltas\n", DELTA >> 10);
        return 2;
    }
    n_deltas = bytes / DELTA;
    values = aligned_alloc(64, n_deltas * DELTA);
    scales = aligned_alloc(64, n_deltas * SCALES * sizeof(uint16_t));
    if (!values || !scales) {
        fprintf(stderr, "out of memory for %zu MiB\n", bytes >> 20);
        return 1;
    }
    for (size_t i = 0; i < n_deltas * DELTA; i++) values[i] = (uint8_t)(i * 2654435761u >> 13);
    for (size_t i = 0; i < n_deltas * SCALES; i++) scales[i] = _cvtss_sh(0.001f * (float)(1 + i % 97), 0);
    for (int k = 0; k < K; k++) u[k] = 0.01f * (float)(k + 1);
    printf("%zu deltas of %d KiB (%zu MiB; the last-level cache: %zu MiB); best of 5 passes, 3 rounds\n",
           n_deltas, DELTA >> 10, (n_deltas * DELTA) >> 20, llc >> 20);
    double best[N_WAYS];
    for (int w = 0; w < N_WAYS; w++) best[w] = 1e9;
    for (int round = 0; round < 3; round++)
        for (int w = 0; w < N_WAYS; w++)
            for (int t = 0; t < 5; t++) {
                const double dt = pass_(w);
                if (dt < best[w]) best[w] = dt;
            }
    for (int w = 0; w < N_WAYS; w++) printf("  %-36s %7.2f us a delta\n", names[w], best[w] * 1e6);
    const double hidden = best[WARM] + best[READ] - best[COLD];
    printf("cold hides %.2f us of the read under the arithmetic: %.0f%% of the smaller of the two\n",
           hidden * 1e6, 100 * hidden / (best[WARM] < best[READ] ? best[WARM] : best[READ]));
    return 0;
}
