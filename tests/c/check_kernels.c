/*
 * check_kernels.c - the kernels through the public C API (lora.h), on every
 * ISA path this CPU and build can run, with no Python in the way.
 *
 * Built by .ci/neon.sh twice: natively (scalar, AVX2, AVX-512 here) and
 * cross-compiled for aarch64 and run under qemu-user (scalar, NEON), with and
 * without OpenMP.  The Python tests reach the same kernels with every dtype
 * of x and out (NumPy arrays and torch tensors are read in place); this file
 * checks them with nothing but the C API, so a bare cross build can run it,
 * and it walks every storage format (LORA_FORMATS) x x x out dtype
 * (LORA_DTYPES) of the registries.
 * For every available path, storage dtype, x dtype and out dtype, over sizes
 * that straddle the register widths:
 *   - accuracy: every float32 result within a forward error bound of a
 *     double-precision reference on the stored weights (|error| <= 4u (n
 *     |s| sum|B||A||x| + |out| + |ref|), n = cols + rank + 4, u = 2^-24,
 *     elementwise; an indexing or lane bug is off by O(1), not by ulps);
 *   - the SIMD path against the portable path: within twice that bound;
 *   - x in float16/bfloat16 gives the bits of x widened to float32;
 *   - a half-precision out is, bit for bit, the float32 out rounded once
 *     (the portable lora_f32_to_f16 / lora_f32_to_bf16), NaN payloads too;
 *     and a sweep of float32 values over every exponent, around both
 *     rounding boundaries, subnormals, overflow, inf and NaN, pushed through
 *     the kernels' vector and scalar rounding;
 *   - batch invariance: row b of a batch call = the decode call on x[b];
 *     the same for the gather (rows of a gather call = one id alone);
 *   - thread invariance: 1 thread vs 2 on shapes above the parallel
 *     threshold (decode, prefill, gather, bank), same bits;
 *   - a stack = its members applied in order (float32 out: bit-identical to
 *     member-by-member calls; half out: the float32 stack result rounded
 *     once), within the bound of the reference;
 *   - a bank row = its entry applied alone, with -1 ids and zero position
 *     scales leaving the row's bits untouched;
 *   - a Q8_0 delta (blocks quantized here by llama.cpp's reference rule) gives,
 *     bit for bit, what the float32 delta holding its dequantized values
 *     d * q gives: decode, batches past the plan's widening, the gather;
 *   - routed experts (LORA_OP_EXPERTS): every (token, slot) pair's row =
 *     its adapter's expert applied alone, x shared by a token's slots or one
 *     per slot, -1 experts / adapters and zero scales untouched, 1 thread =
 *     2 threads, and out-of-range expert / adapter ids refused with their
 *     position before anything is written.
 * Prints one line per path and "check_kernels: N passed, M failed"; exits
 * 1 on any failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h" /* lora.h, and the portable conversions used as the reference */

/* The calls these checks make, each one lora_call through lora_apply (the one apply entry
 * point): a delta alone (a table of one entry of one member), a table with entry ids and
 * position scales, the gather, and routed experts.  The delta's rows and cols come from
 * lora_delta_dims. */
static int apply_(int op, int64_t n_entries, const int64_t *first, const lora_delta *const *dp,
                  const double *sc, const int64_t *eid, const double *ps, int64_t every,
                  int64_t rows, int64_t cols, int64_t n, const int64_t *ids, const void *x, int xt,
                  int64_t ldx, void *out, int ot, int64_t ldo, int64_t *bad) {
    lora_call c;
    memset(&c, 0, sizeof c);
    c.op = op, c.n_entries = n_entries, c.first = first, c.deltas = dp, c.scales = sc;
    c.entry_ids = eid, c.pos_scales = ps, c.ids_every = every, c.rows = rows, c.cols = cols;
    c.n = n, c.ids = ids, c.x = x, c.x_dtype = xt, c.ldx = ldx, c.out = out, c.out_dtype = ot;
    c.ldo = ldo, c.bad = bad;
    return lora_apply(&c);
}

static int add_batch_(const lora_delta *d, float s, int64_t n, const void *x, int xt, int64_t ldx,
                      void *out, int ot, int64_t ldo) {
    static const int64_t first[2] = {0, 1};
    const double sc = s;
    int64_t rows, cols;
    lora_delta_dims(d, NULL, &rows, &cols);
    return apply_(LORA_OP_PROJECT, 1, first, &d, &sc, NULL, NULL, 1, rows, cols, n, NULL, x, xt,
                  ldx, out, ot, ldo, NULL);
}

static int add_(const lora_delta *d, float s, const void *x, int xt, void *out, int ot) {
    int64_t rows, cols;
    lora_delta_dims(d, NULL, &rows, &cols);
    return add_batch_(d, s, 1, x, xt, cols, out, ot, rows);
}

static int add_rows_(const lora_delta *d, float s, int64_t n, const int64_t *ids, void *out, int ot,
                     int64_t ldo, int64_t *bad) {
    static const int64_t first[2] = {0, 1};
    const double sc = s;
    int64_t rows, cols;
    lora_delta_dims(d, NULL, &rows, &cols);
    return apply_(LORA_OP_ROWS, 1, first, &d, &sc, NULL, NULL, 1, rows, cols, n, ids, NULL, 0, 0,
                  out, ot, ldo, bad);
}

static int apply_batch_(int64_t ne, const int64_t *first, const lora_delta *const *dp,
                        const double *sc, const int64_t *eid, const double *ps, int64_t every,
                        int64_t rows, int64_t cols, int64_t n, const void *x, int xt, int64_t ldx,
                        void *out, int ot, int64_t ldo, int64_t *bad) {
    return apply_(LORA_OP_PROJECT, ne, first, dp, sc, eid, ps, every, rows, cols, n, NULL, x, xt,
                  ldx, out, ot, ldo, bad);
}

static int apply_rows_(int64_t ne, const int64_t *first, const lora_delta *const *dp,
                       const double *sc, const int64_t *eid, const double *ps, int64_t every,
                       int64_t rows, int64_t cols, int64_t n, const int64_t *ids, void *out, int ot,
                       int64_t ldo, int64_t *bad) {
    return apply_(LORA_OP_ROWS, ne, first, dp, sc, eid, ps, every, rows, cols, n, ids, NULL, 0, 0,
                  out, ot, ldo, bad);
}

static int apply_experts_(int64_t ne, const int64_t *first, const lora_delta *const *dp,
                          const double *sc, int64_t n_adapters, const int64_t *starts,
                          int64_t n_experts, const int64_t *aid, const double *ps, int64_t every,
                          const int64_t *eid, int64_t x_every, int64_t rows, int64_t cols,
                          int64_t n, const void *x, int xt, int64_t ldx, void *out, int ot,
                          int64_t ldo, int64_t *bad) {
    lora_call c;
    memset(&c, 0, sizeof c);
    c.op = LORA_OP_EXPERTS, c.n_entries = ne, c.first = first, c.deltas = dp, c.scales = sc;
    c.n_adapters = n_adapters, c.starts = starts, c.n_experts = n_experts, c.entry_ids = aid;
    c.pos_scales = ps, c.ids_every = every, c.expert_ids = eid, c.x_every = x_every;
    c.rows = rows, c.cols = cols, c.n = n, c.x = x, c.x_dtype = xt, c.ldx = ldx, c.out = out;
    c.out_dtype = ot, c.ldo = ldo, c.bad = bad;
    return lora_apply(&c);
}

static long g_pass, g_fail;
static const char *g_isa = "?";
static char g_what[256];

#define CHECK(cond, ...)                                                                       \
    do {                                                                                       \
        if (cond) {                                                                            \
            g_pass++;                                                                          \
        } else {                                                                               \
            if (g_fail++ < 20) {                                                               \
                printf("FAIL [%s] %s: ", g_isa, g_what);                                       \
                printf(__VA_ARGS__);                                                           \
                printf("\n");                                                                  \
            }                                                                                  \
        }                                                                                      \
    } while (0)

#define DT_NAME_(A, CODE, NAME, BYTES, BITS) [CODE] = #NAME,
static const char *DT[LORA_DTYPE_COUNT] = {LORA_DTYPES(DT_NAME_, )};
#define FMT_NAME_(A, CODE, NAME, BLOCK, BYTES, VALUE, WORK) [CODE] = #NAME,
static const char *FMT[LORA_FMT_COUNT] = {LORA_FORMATS(FMT_NAME_, )};
static const char *ISA_NAME[LORA_ISA_COUNT] = {[LORA_ISA_SCALAR] = "scalar", [LORA_ISA_AVX2] = "avx2",
                                               [LORA_ISA_AVX512] = "avx512", [LORA_ISA_NEON] = "neon"};

/* ------------------------------------------------------------------ data */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float uniform(void) { return (float)((next_u64() >> 40) * (1.0 / 16777216.0)); }
/* roughly normal (sum of 4 uniforms, centred), deterministic */
static float randn(void) { return (uniform() + uniform() + uniform() + uniform() - 2.0f) * 1.7f; }

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        printf("out of memory\n");
        exit(2);
    }
    return p;
}

/* n random values in dtype dt (the bits), and their float32 values in w */
static void *rand_array(int64_t n, int dt, float *w, float scale) {
    void *p = xmalloc((size_t)n * lora_dtype_size(dt));
    for (int64_t i = 0; i < n; i++) {
        lora_store_f32(p, i, randn() * scale, dt);
        w[i] = lora_load_f32(p, i, dt);
    }
    return p;
}

static int same_bits(const void *a, const void *b, int64_t n, int dt) {
    return memcmp(a, b, (size_t)n * lora_dtype_size(dt)) == 0;
}

/* a delta of random weights; a64/b64 get the stored values (row-major a [rank, cols], b [rows, rank]) */
typedef struct {
    lora_delta *d;
    int64_t rank, rows, cols;
    double *a, *b;
} delta_t;

/* llama.cpp's quantize_row_q8_0_ref on n rows of len values (w: row r at w + r * stride_r,
 * value j at + j * stride_j) into n rows of ceil(len / 32) blocks at dst (a float16 d, 32 int8
 * q); w gets the dequantized values d * q back */
static void quantize_q8_0(float *w, int64_t n, int64_t len, int64_t stride_r, int64_t stride_j,
                          unsigned char *dst) {
    const int64_t nblk = (len + 31) / 32;
    for (int64_t r = 0; r < n; r++)
        for (int64_t k = 0; k < nblk; k++) {
            unsigned char *blk = dst + (size_t)((r * nblk + k) * 34);
            const int64_t m = len - 32 * k < 32 ? len - 32 * k : 32;
            float amax = 0.0f;
            for (int64_t j = 0; j < m; j++) {
                const float v = fabsf(w[r * stride_r + (32 * k + j) * stride_j]);
                if (v > amax) amax = v;
            }
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const uint16_t h = lora_f32_to_f16(d);
            const float dh = lora_f16_to_f32(h);
            blk[0] = (unsigned char)(h & 0xffu), blk[1] = (unsigned char)(h >> 8);
            memset(blk + 2, 0, 32);
            for (int64_t j = 0; j < m; j++) {
                float *v = &w[r * stride_r + (32 * k + j) * stride_j];
                const int8_t q = (int8_t)roundf(*v * id);
                blk[2 + j] = (unsigned char)q;
                *v = (float)q * dh;
            }
        }
}

static delta_t make_delta(int fmt, int64_t rank, int64_t rows, int64_t cols) {
    delta_t r = {NULL, rank, rows, cols, NULL, NULL};
    float *wa = (float *)xmalloc(sizeof(float) * (size_t)(rank * cols));
    float *wb = (float *)xmalloc(sizeof(float) * (size_t)(rows * rank));
    void *a, *b;
    if (fmt == LORA_FMT_Q8_0) { /* A's rows and B's columns (B^T's rows), blocks of 32 */
        a = xmalloc((size_t)(rank * ((cols + 31) / 32) * 34));
        b = xmalloc((size_t)(rank * ((rows + 31) / 32) * 34));
        for (int64_t i = 0; i < rank * cols; i++) wa[i] = randn();
        for (int64_t i = 0; i < rows * rank; i++) wb[i] = randn() * (1.0f + (float)(i % 5));
        quantize_q8_0(wa, rank, cols, cols, 1, (unsigned char *)a);
        quantize_q8_0(wb, rank, rows, 1, rank, (unsigned char *)b);
    } else { /* an element format is its dtype */
        a = rand_array(rank * cols, fmt, wa, 1.0f), b = rand_array(rows * rank, fmt, wb, 1.0f);
    }
    r.d = lora_delta_new(fmt, fmt, rank, rows, cols, a, b);
    if (!r.d) {
        printf("lora_delta_new failed\n");
        exit(2);
    }
    r.a = (double *)xmalloc(sizeof(double) * (size_t)(rank * cols));
    r.b = (double *)xmalloc(sizeof(double) * (size_t)(rows * rank));
    for (int64_t i = 0; i < rank * cols; i++) r.a[i] = wa[i];
    for (int64_t i = 0; i < rows * rank; i++) r.b[i] = wb[i];
    free(wa), free(wb), free(a), free(b);
    return r;
}

static void free_delta(delta_t *d) {
    lora_delta_free(d->d);
    free(d->a), free(d->b);
}

/* ref[b*rows + i] += s * (B A x_b)[i] in double; mag[..] += |s| sum_k |B_ik| sum_j |A_kj x_j| */
static void ref_batch(const delta_t *d, double s, int64_t batch, const float *x, double *ref,
                      double *mag) {
    double *t = (double *)xmalloc(sizeof(double) * (size_t)(2 * d->rank));
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t k = 0; k < d->rank; k++) {
            double acc = 0, am = 0;
            for (int64_t j = 0; j < d->cols; j++) {
                acc += d->a[k * d->cols + j] * x[b * d->cols + j];
                am += fabs(d->a[k * d->cols + j] * x[b * d->cols + j]);
            }
            t[k] = acc, t[d->rank + k] = am;
        }
        for (int64_t i = 0; i < d->rows; i++) {
            double acc = 0, m = 0;
            for (int64_t k = 0; k < d->rank; k++) {
                acc += d->b[i * d->rank + k] * t[k];
                m += fabs(d->b[i * d->rank + k]) * t[d->rank + k];
            }
            ref[b * d->rows + i] += s * acc;
            mag[b * d->rows + i] += fabs(s) * m;
        }
    }
    free(t);
}

/* ref[i*cols + j] += s * (B[ids[i]] A)[j] */
static void ref_rows(const delta_t *d, double s, int64_t n, const int64_t *ids, double *ref,
                     double *mag) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < d->cols; j++) {
            double acc = 0, m = 0;
            for (int64_t k = 0; k < d->rank; k++) {
                acc += d->b[ids[i] * d->rank + k] * d->a[k * d->cols + j];
                m += fabs(d->b[ids[i] * d->rank + k] * d->a[k * d->cols + j]);
            }
            ref[i * d->cols + j] += s * acc;
            mag[i * d->cols + j] += fabs(s) * m;
        }
}

static double bound_(double mag, double out0, double ref, int64_t n) {
    return 4.0 * 0x1p-24 * ((double)n * mag + fabs(out0) + fabs(ref)) + 1e-30;
}

/* every float32 result within the bound; returns the largest error / bound */
static void check_accurate(const float *got, const double *ref, const double *mag,
                           const float *out0, int64_t n, int64_t depth, const char *what) {
    double worst = 0;
    int64_t at = -1;
    for (int64_t i = 0; i < n; i++) {
        const double e = fabs((double)got[i] - ref[i]) / bound_(mag[i], out0[i], ref[i], depth);
        if (!(e <= worst)) worst = e, at = i;
    }
    CHECK(worst <= 1.0, "%s: element %lld is %.3g x the error bound (got %.9g, ref %.9g)", what,
          (long long)at, worst, at >= 0 ? got[at] : 0.0, at >= 0 ? ref[at] : 0.0);
}

/* dst (dtype ot) = src rounded with the portable conversions */
static void narrow_ref(const float *src, int64_t n, void *dst, int ot) {
    for (int64_t i = 0; i < n; i++) lora_store_f32(dst, i, src[i], ot);
}

static void set_isa(int isa) {
    if (lora_set_isa(isa) != LORA_OK) {
        printf("lora_set_isa(%d) failed\n", isa);
        exit(2);
    }
}

/* ------------------------------------------------ decode, prefill, gather */

/* one delta of storage dt, every x dtype and out dtype, batch positions */
static void check_shape(int isa, int dt, int64_t rank, int64_t rows, int64_t cols,
                        int64_t batch) {
    delta_t d = make_delta(dt, rank, rows, cols);
    const float s = 0.75f;
    const int64_t nx = batch * cols, no = batch * rows;
    float *xw = (float *)xmalloc(sizeof(float) * (size_t)nx);
    float *ow = (float *)xmalloc(sizeof(float) * (size_t)no);
    float *o32 = (float *)xmalloc(sizeof(float) * (size_t)no);
    float *oscalar = (float *)xmalloc(sizeof(float) * (size_t)no);
    double *ref = (double *)xmalloc(sizeof(double) * (size_t)no);
    double *mag = (double *)xmalloc(sizeof(double) * (size_t)no);
    void *got = xmalloc((size_t)no * 4), *want = xmalloc((size_t)no * 4), *one = xmalloc(4 * (size_t)rows);
    for (int xt = 0; xt < LORA_DTYPE_COUNT; xt++) {
        void *x = rand_array(nx, xt, xw, 1.0f);
        for (int ot = 0; ot < LORA_DTYPE_COUNT; ot++) {
            void *out0 = rand_array(no, ot, ow, 2.0f);
            snprintf(g_what, sizeof g_what, "prefill st=%s x=%s out=%s rank=%lld rows=%lld cols=%lld batch=%lld",
                     FMT[dt], DT[xt], DT[ot], (long long)rank, (long long)rows, (long long)cols,
                     (long long)batch);
            /* float32 x and out holding the same values: the reference result */
            memcpy(o32, ow, sizeof(float) * (size_t)no);
            CHECK(add_batch_(d.d, s, batch, xw, LORA_DTYPE_F32, cols, o32, LORA_DTYPE_F32, rows) == LORA_OK, "status");
            for (int64_t i = 0; i < no; i++) ref[i] = ow[i], mag[i] = 0;
            ref_batch(&d, s, batch, xw, ref, mag);
            if (xt == 0 && ot == 0) {
                check_accurate(o32, ref, mag, ow, no, cols + rank + 4, "float32 result vs double reference");
                if (isa != LORA_ISA_SCALAR) {
                    set_isa(LORA_ISA_SCALAR);
                    memcpy(oscalar, ow, sizeof(float) * (size_t)no);
                    add_batch_(d.d, s, batch, xw, LORA_DTYPE_F32, cols, oscalar, LORA_DTYPE_F32, rows);
                    set_isa(isa);
                    double worst = 0;
                    for (int64_t i = 0; i < no; i++) {
                        const double e = fabs((double)o32[i] - oscalar[i]) /
                                         bound_(mag[i], ow[i], ref[i], cols + rank + 4);
                        if (e > worst) worst = e;
                    }
                    CHECK(worst <= 2.0, "vs the portable path: %.3g x the bound", worst);
                }
            }
            /* the call in these dtypes: the float32 result, rounded once into ot */
            memcpy(got, out0, (size_t)no * lora_dtype_size(ot));
            CHECK(add_batch_(d.d, s, batch, x, xt, cols, got, ot, rows) == LORA_OK, "status");
            narrow_ref(o32, no, want, ot);
            CHECK(same_bits(got, want, no, ot), "not the float32 result rounded once");
            /* batch invariance: each row = the decode call */
            for (int64_t b = 0; b < batch; b++) {
                memcpy(one, (char *)out0 + b * rows * lora_dtype_size(ot), (size_t)rows * lora_dtype_size(ot));
                add_(d.d, s, (char *)x + b * cols * lora_dtype_size(xt), xt, one, ot);
                CHECK(same_bits(one, (char *)got + b * rows * lora_dtype_size(ot), rows, ot),
                      "row %lld of the batch differs from the decode call", (long long)b);
            }
            free(out0);
        }
        free(x);
    }
    /* gather: ids with repeats, every out dtype */
    const int64_t n = batch + 1;
    int64_t *ids = (int64_t *)xmalloc(sizeof(int64_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) ids[i] = (int64_t)(next_u64() % (uint64_t)rows);
    ids[n - 1] = ids[0];
    float *gw = (float *)xmalloc(sizeof(float) * (size_t)(n * cols));
    float *g32 = (float *)xmalloc(sizeof(float) * (size_t)(n * cols));
    double *gref = (double *)xmalloc(sizeof(double) * (size_t)(n * cols));
    double *gmag = (double *)xmalloc(sizeof(double) * (size_t)(n * cols));
    void *gg = xmalloc((size_t)(n * cols) * 4), *gwant = xmalloc((size_t)(n * cols) * 4);
    void *gone = xmalloc((size_t)cols * 4);
    for (int ot = 0; ot < LORA_DTYPE_COUNT; ot++) {
        snprintf(g_what, sizeof g_what, "gather st=%s out=%s rank=%lld rows=%lld cols=%lld", FMT[dt],
                 DT[ot], (long long)rank, (long long)rows, (long long)cols);
        void *out0 = rand_array(n * cols, ot, gw, 2.0f);
        memcpy(g32, gw, sizeof(float) * (size_t)(n * cols));
        int64_t bad;
        CHECK(add_rows_(d.d, s, n, ids, g32, LORA_DTYPE_F32, cols, &bad) == LORA_OK, "status");
        for (int64_t i = 0; i < n * cols; i++) gref[i] = gw[i], gmag[i] = 0;
        ref_rows(&d, s, n, ids, gref, gmag);
        check_accurate(g32, gref, gmag, gw, n * cols, rank + 4, "gather vs double reference");
        memcpy(gg, out0, (size_t)(n * cols) * lora_dtype_size(ot));
        CHECK(add_rows_(d.d, s, n, ids, gg, ot, cols, &bad) == LORA_OK, "status");
        narrow_ref(g32, n * cols, gwant, ot);
        CHECK(same_bits(gg, gwant, n * cols, ot), "gather: not the float32 result rounded once");
        for (int64_t i = 0; i < n; i++) {
            memcpy(gone, (char *)out0 + i * cols * lora_dtype_size(ot), (size_t)cols * lora_dtype_size(ot));
            add_rows_(d.d, s, 1, ids + i, gone, ot, cols, &bad);
            CHECK(same_bits(gone, (char *)gg + i * cols * lora_dtype_size(ot), cols, ot),
                  "gather row %lld differs from the id alone", (long long)i);
        }
        free(out0);
    }
    free(ids), free(gw), free(g32), free(gref), free(gmag), free(gg), free(gwant), free(gone);
    free(xw), free(ow), free(o32), free(oscalar), free(ref), free(mag), free(got), free(want), free(one);
    free_delta(&d);
}

/* ------------------------------------------------------------- Q8_0 */

/* A Q8_0 delta against the float32 delta holding its dequantized values: the same bits for
 * every x and out dtype, decode, small and widened batches, and the gather */
static void check_q8_0_is_f32(int64_t rank, int64_t rows, int64_t cols) {
    delta_t q = make_delta(LORA_FMT_Q8_0, rank, rows, cols);
    float *a = (float *)xmalloc(sizeof(float) * (size_t)(rank * cols));
    float *b = (float *)xmalloc(sizeof(float) * (size_t)(rows * rank));
    for (int64_t i = 0; i < rank * cols; i++) a[i] = (float)q.a[i];
    for (int64_t i = 0; i < rows * rank; i++) b[i] = (float)q.b[i];
    lora_delta *f = lora_delta_new(LORA_FMT_F32, LORA_FMT_F32, rank, rows, cols, a, b);
    float *tmp = (float *)xmalloc(sizeof(float) * (size_t)(70 * (rows > cols ? rows : cols)));
    static const int64_t NS[3] = {1, 6, 70};
    for (int xt = 0; xt < LORA_DTYPE_COUNT; xt++)
        for (int ot = 0; ot < LORA_DTYPE_COUNT; ot++)
            for (int k = 0; k < 3; k++) {
                const int64_t n = NS[k];
                snprintf(g_what, sizeof g_what, "q8_0 = f32 x=%s out=%s rank=%lld rows=%lld cols=%lld n=%lld",
                         DT[xt], DT[ot], (long long)rank, (long long)rows, (long long)cols, (long long)n);
                void *x = rand_array(n * cols, xt, tmp, 1.0f);
                void *o1 = rand_array(n * rows, ot, tmp, 2.0f);
                void *o2 = xmalloc((size_t)(n * rows) * lora_dtype_size(ot));
                memcpy(o2, o1, (size_t)(n * rows) * lora_dtype_size(ot));
                add_batch_(q.d, 0.625f, n, x, xt, cols, o1, ot, rows);
                add_batch_(f, 0.625f, n, x, xt, cols, o2, ot, rows);
                CHECK(same_bits(o1, o2, n * rows, ot), "batch: not the float32 delta's bits");
                free(x), free(o1), free(o2);
            }
    int64_t ids[9], bad;
    for (int i = 0; i < 9; i++) ids[i] = (int64_t)(next_u64() % (uint64_t)rows);
    void *g1 = rand_array(9 * cols, LORA_DTYPE_F32, tmp, 1.0f);
    void *g2 = xmalloc((size_t)(9 * cols) * 4);
    memcpy(g2, g1, (size_t)(9 * cols) * 4);
    add_rows_(q.d, 0.625f, 9, ids, g1, LORA_DTYPE_F32, cols, &bad);
    add_rows_(f, 0.625f, 9, ids, g2, LORA_DTYPE_F32, cols, &bad);
    CHECK(same_bits(g1, g2, 9 * cols, LORA_DTYPE_F32), "gather: not the float32 delta's bits");
    free(g1), free(g2), free(tmp), free(a), free(b);
    lora_delta_free(f);
    free_delta(&q);
}

/* ------------------------------------------------------------- threads */

/* f(out) with 1 thread and with 2: same bits */
static void check_threads_batch(int dt, int ot, int64_t rank, int64_t rows, int64_t cols,
                                int64_t batch) {
    delta_t d = make_delta(dt, rank, rows, cols);
    float *xw = (float *)xmalloc(sizeof(float) * (size_t)(batch * cols));
    float *ow = (float *)xmalloc(sizeof(float) * (size_t)(batch * rows));
    void *x = rand_array(batch * cols, LORA_DTYPE_BF16, xw, 1.0f);
    void *out0 = rand_array(batch * rows, ot, ow, 1.0f);
    const size_t ob = (size_t)(batch * rows) * lora_dtype_size(ot);
    void *o1 = xmalloc(ob), *o2 = xmalloc(ob);
    snprintf(g_what, sizeof g_what, "threads st=%s out=%s rank=%lld rows=%lld cols=%lld batch=%lld",
             FMT[dt], DT[ot], (long long)rank, (long long)rows, (long long)cols, (long long)batch);
    memcpy(o1, out0, ob), memcpy(o2, out0, ob);
    lora_set_num_threads(1);
    add_batch_(d.d, 0.5f, batch, x, LORA_DTYPE_BF16, cols, o1, ot, rows);
    lora_set_num_threads(2);
    add_batch_(d.d, 0.5f, batch, x, LORA_DTYPE_BF16, cols, o2, ot, rows);
    lora_set_num_threads(0);
    CHECK(memcmp(o1, o2, ob) == 0, "1 thread and 2 threads differ");
    /* gather on the same delta */
    int64_t ids[5] = {0, rows - 1, rows / 2, 3 % rows, 0}, bad;
    const size_t gb = (size_t)(5 * cols) * lora_dtype_size(ot);
    void *g1 = calloc(1, gb), *g2 = calloc(1, gb);
    lora_set_num_threads(1);
    add_rows_(d.d, 0.5f, 5, ids, g1, ot, cols, &bad);
    lora_set_num_threads(2);
    add_rows_(d.d, 0.5f, 5, ids, g2, ot, cols, &bad);
    lora_set_num_threads(0);
    CHECK(memcmp(g1, g2, gb) == 0, "gather: 1 thread and 2 threads differ");
    free(g1), free(g2), free(o1), free(o2), free(x), free(out0), free(xw), free(ow);
    free_delta(&d);
}

/* ------------------------------------------------------- stacks, banks */

static void check_stack_and_bank(int ot, int64_t rows, int64_t cols, int64_t batch, int threads) {
    /* members of every storage dtype and different ranks */
    delta_t m[4] = {make_delta(LORA_DTYPE_F32, 5, rows, cols), make_delta(LORA_DTYPE_F16, 17, rows, cols),
                    make_delta(LORA_DTYPE_BF16, 33, rows, cols), make_delta(LORA_FMT_Q8_0, 8, rows, cols)};
    const lora_delta *dp[4] = {m[0].d, m[1].d, m[2].d, m[3].d};
    const double sc[4] = {0.75, -1.25, 0.5, 2.0};
    const int64_t no = batch * rows;
    const size_t ob = (size_t)no * lora_dtype_size(ot), osz = lora_dtype_size(ot);
    float *xw = (float *)xmalloc(sizeof(float) * (size_t)(batch * cols));
    float *ow = (float *)xmalloc(sizeof(float) * (size_t)no);
    float *o32 = (float *)xmalloc(sizeof(float) * (size_t)no);
    void *x = rand_array(batch * cols, LORA_DTYPE_F16, xw, 1.0f);
    void *out0 = rand_array(no, ot, ow, 1.0f);
    void *got = xmalloc(ob), *want = xmalloc(ob), *seq = xmalloc(ob);
    double *ref = (double *)xmalloc(sizeof(double) * (size_t)no);
    double *mag = (double *)xmalloc(sizeof(double) * (size_t)no);
    int64_t bad;
    lora_set_num_threads(threads);

    /* the stack [m0, m1, m2] as one entry */
    snprintf(g_what, sizeof g_what, "stack out=%s rows=%lld cols=%lld batch=%lld threads=%d", DT[ot],
             (long long)rows, (long long)cols, (long long)batch, threads);
    const int64_t first1[2] = {0, 3};
    memcpy(o32, ow, sizeof(float) * (size_t)no);
    CHECK(apply_batch_(1, first1, dp, sc, NULL, NULL, 1, rows, cols, batch, xw, LORA_DTYPE_F32,
                           cols, o32, LORA_DTYPE_F32, rows, &bad) == LORA_OK, "status");
    for (int64_t i = 0; i < no; i++) ref[i] = ow[i], mag[i] = 0;
    for (int q = 0; q < 3; q++) ref_batch(&m[q], (float)sc[q], batch, xw, ref, mag);
    check_accurate(o32, ref, mag, ow, no, cols + 33 + 4, "stack vs double reference");
    /* float32 out: member by member gives the same bits */
    float *s32 = (float *)xmalloc(sizeof(float) * (size_t)no);
    memcpy(s32, ow, sizeof(float) * (size_t)no);
    for (int q = 0; q < 3; q++)
        add_batch_(dp[q], (float)sc[q], batch, xw, LORA_DTYPE_F32, cols, s32, LORA_DTYPE_F32, rows);
    CHECK(memcmp(s32, o32, sizeof(float) * (size_t)no) == 0, "stack != its members applied in order");
    free(s32);
    memcpy(got, out0, ob);
    apply_batch_(1, first1, dp, sc, NULL, NULL, 1, rows, cols, batch, x, LORA_DTYPE_F16, cols,
                     got, ot, rows, &bad);
    narrow_ref(o32, no, want, ot);
    CHECK(same_bits(got, want, no, ot), "stack: not the float32 result rounded once");

    /* a bank: entry 0 = m0, entry 1 = [m1, m2], entry 2 = m3; ids with -1, scales with 0 */
    snprintf(g_what, sizeof g_what, "bank out=%s rows=%lld cols=%lld batch=%lld threads=%d", DT[ot],
             (long long)rows, (long long)cols, (long long)batch, threads);
    const int64_t first3[4] = {0, 1, 3, 4};
    int64_t *eid = (int64_t *)xmalloc(sizeof(int64_t) * (size_t)batch);
    double *ps = (double *)xmalloc(sizeof(double) * (size_t)batch);
    for (int64_t b = 0; b < batch; b++) {
        eid[b] = (int64_t)(next_u64() % 4) - 1;
        ps[b] = b % 5 == 3 ? 0.0 : 0.5 + uniform();
    }
    memcpy(got, out0, ob);
    CHECK(apply_batch_(3, first3, dp, sc, eid, ps, 1, rows, cols, batch, x, LORA_DTYPE_F16, cols,
                           got, ot, rows, &bad) == LORA_OK, "status");
    for (int64_t b = 0; b < batch; b++) {
        void *row = (char *)seq + b * rows * osz;
        memcpy(row, (char *)out0 + b * rows * osz, (size_t)rows * osz);
        if (eid[b] >= 0) {
            const int64_t e = eid[b], f[2] = {0, first3[e + 1] - first3[e]};
            apply_batch_(1, f, dp + first3[e], sc + first3[e], NULL, ps + b, 1, rows, cols, 1,
                             (char *)x + b * cols * 2, LORA_DTYPE_F16, cols, row, ot, rows, &bad);
        }
        CHECK(same_bits(row, (char *)got + b * rows * osz, rows, ot),
              "bank row %lld (entry %lld, scale %g) differs from the entry alone", (long long)b,
              (long long)eid[b], ps[b]);
        if (eid[b] < 0 || ps[b] == 0.0)
            CHECK(same_bits((char *)out0 + b * rows * osz, (char *)got + b * rows * osz, rows, ot),
                  "bank row %lld with no adapter was touched", (long long)b);
    }
    /* the bank's gather: rows of the embedding, out [batch, cols] */
    const int64_t ng = batch * cols;
    const size_t gb = (size_t)ng * osz;
    int64_t *tok = (int64_t *)xmalloc(sizeof(int64_t) * (size_t)batch);
    for (int64_t b = 0; b < batch; b++) tok[b] = (int64_t)(next_u64() % (uint64_t)rows);
    float *gw = (float *)xmalloc(sizeof(float) * (size_t)ng);
    void *g0 = rand_array(ng, ot, gw, 1.0f), *gg = xmalloc(gb), *gs = xmalloc(gb);
    memcpy(gg, g0, gb);
    CHECK(apply_rows_(3, first3, dp, sc, eid, ps, 1, rows, cols, batch, tok, gg, ot, cols, &bad) == LORA_OK,
          "status");
    for (int64_t b = 0; b < batch; b++) {
        void *row = (char *)gs + b * cols * osz;
        memcpy(row, (char *)g0 + b * cols * osz, (size_t)cols * osz);
        if (eid[b] >= 0) {
            const int64_t e = eid[b], f[2] = {0, first3[e + 1] - first3[e]};
            apply_rows_(1, f, dp + first3[e], sc + first3[e], NULL, ps + b, 1, rows, cols, 1,
                            tok + b, row, ot, cols, &bad);
        }
        CHECK(same_bits(row, (char *)gg + b * cols * osz, cols, ot),
              "bank gather row %lld differs from the entry alone", (long long)b);
    }
    lora_set_num_threads(0);
    free(tok), free(gw), free(g0), free(gg), free(gs), free(eid), free(ps);
    free(xw), free(ow), free(o32), free(x), free(out0), free(got), free(want), free(seq), free(ref), free(mag);
    for (int q = 0; q < 4; q++) free_delta(&m[q]);
}

/* ----------------------------------------------- rounding of a half out */

/* out = 0 + 1 * (B (A x)) with cols = 1, A = [[1]], B = [1, 2, 0.5, -1, 1]: each
 * output is x_b times a power of two (exact for most values; the check does not
 * depend on it), so the float32 values reaching the rounding sweep x. */
static void check_rounding(int ot) {
    /* low mantissa bits around the float16 (bit 12) and bfloat16 (bit 15) boundaries */
    static const uint32_t low[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x2fff, 0x3000,
                                   0x7fff, 0x8000, 0x8001, 0x17fff, 0x18000, 0x1fff, 0x3001};
    const int nlow = (int)(sizeof low / sizeof low[0]);
    int64_t n = 0, cap = 2 * 256 * 8 * nlow + 64;
    float *xs = (float *)xmalloc(sizeof(float) * (size_t)cap);
    for (uint32_t sign = 0; sign < 2; sign++)
        for (uint32_t e = 0; e < 256; e++)
            for (int hi = 0; hi < 8; hi++) {
                const uint32_t top = hi < 2 ? (hi ? 0x7f0000u : 0) : (uint32_t)(next_u64() & 0x7e0000u);
                for (int l = 0; l < nlow; l++) {
                    union { uint32_t u; float f; } v = {sign << 31 | e << 23 | top | low[l]};
                    if (e == 255 && (top | low[l]) == 0 && l) continue;
                    xs[n++] = v.f;  /* inf and NaNs (quiet and signalling payloads) included */
                }
            }
    static const uint32_t special[] = {0x477fefffu, 0x477ff000u, 0x477ff001u, 0x7f7fffffu,
                                       0x7f7f8000u, 0x7f7f7fffu, 0x33000000u, 0x33000001u,
                                       0x387fe000u, 0x387ff000u, 0x7fc00000u, 0x7f800001u,
                                       0xffc12345u, 0x00000001u, 0x80000000u};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) {
        union { uint32_t u; float f; } v = {special[i]};
        xs[n++] = v.f;
    }
    const int64_t rows = 5;
    const float a[1] = {1.0f}, b[5] = {1.0f, 2.0f, 0.5f, -1.0f, 1.0f};
    lora_delta *d = lora_delta_new(LORA_FMT_F32, LORA_FMT_F32, 1, rows, 1, a, b);
    float *o32 = (float *)calloc((size_t)(n * rows), sizeof(float));
    uint16_t *oh = (uint16_t *)calloc((size_t)(n * rows), sizeof(uint16_t));
    uint16_t *want = (uint16_t *)xmalloc(sizeof(uint16_t) * (size_t)(n * rows));
    snprintf(g_what, sizeof g_what, "rounding sweep out=%s (%lld values)", DT[ot], (long long)n);
    add_batch_(d, 1.0f, n, xs, LORA_DTYPE_F32, 1, o32, LORA_DTYPE_F32, rows);
    add_batch_(d, 1.0f, n, xs, LORA_DTYPE_F32, 1, oh, ot, rows);
    narrow_ref(o32, n * rows, want, ot);
    int64_t bad = -1, nbad = 0;
    for (int64_t i = 0; i < n * rows; i++)
        if (oh[i] != want[i]) nbad++, bad = bad < 0 ? i : bad;
    union { float f; uint32_t u; } v = {bad >= 0 ? o32[bad] : 0.0f};
    CHECK(nbad == 0, "%lld values rounded differently from the portable conversion; first: "
          "float32 0x%08x -> 0x%04x, portable 0x%04x", (long long)nbad, v.u,
          bad >= 0 ? oh[bad] : 0, bad >= 0 ? want[bad] : 0);
    /* and the values really covered what they should: finite, overflowing, subnormal, nan */
    int64_t n_inf = 0, n_nan = 0, n_sub = 0;
    for (int64_t i = 0; i < n * rows; i++) {
        const float w = lora_load_f32(oh, i, ot);
        n_inf += isinf(w) && !isinf(o32[i]);
        n_nan += isnan(w);
        n_sub += ot == LORA_DTYPE_F16 && (oh[i] & 0x7c00u) == 0 && (oh[i] & 0x3ffu) != 0;
    }
    CHECK(n_inf > 0 && n_nan > 0 && (ot != LORA_DTYPE_F16 || n_sub > 0),
          "the sweep missed a class: %lld overflows, %lld NaNs, %lld subnormals", (long long)n_inf,
          (long long)n_nan, (long long)n_sub);
    lora_delta_free(d);
    free(xs), free(o32), free(oh), free(want);
}

/* ------------------------------------------------------------- statuses */

/* Routed experts: 3 adapter slots of 5 experts (slot 1 empty), experts of several storage
 * dtypes and ranks, T tokens x k slots with repeated and -1 experts, adapters and scales per
 * token; x one row per token (shared) or one per slot. */
static void check_experts(int ot, int shared, int64_t rows, int64_t cols, int64_t T, int threads) {
    enum { E = 5, K = 3 };
    delta_t m[2 * E];
    const lora_delta *dp[2 * E];
    double sc[2 * E];
    for (int q = 0; q < 2 * E; q++) {
        m[q] = make_delta(q % LORA_FMT_COUNT, 1 + 7 * (q % 3), rows, cols);
        dp[q] = m[q].d;
        sc[q] = 0.25 * (q + 1) * (q % 2 ? -1 : 1);
    }
    /* kernel entries: 0..4 adapter 0's experts, 5 the empty slot, 6..10 adapter 2's */
    int64_t first[2 * E + 2];
    for (int e = 0, q = 0; e <= 2 * E + 1; e++) first[e] = q, q += (e < 2 * E + 1 && e != E);
    const int64_t starts[4] = {0, E, E + 1, 2 * E + 1};
    const int64_t n = T * K, nx = shared ? T : n, no = n * rows;
    const size_t osz = lora_dtype_size(ot), ob = (size_t)no * osz;
    float *xw = (float *)xmalloc(sizeof(float) * (size_t)(nx * cols));
    void *x = rand_array(nx * cols, LORA_DTYPE_BF16, xw, 1.0f);
    float *ow = (float *)xmalloc(sizeof(float) * (size_t)no);
    void *out0 = rand_array(no, ot, ow, 1.0f), *got = xmalloc(ob), *two = xmalloc(ob);
    void *row = xmalloc((size_t)rows * osz);
    int64_t *eid = (int64_t *)xmalloc(sizeof(int64_t) * (size_t)n), aid[64], bad;
    double ps[64];
    for (int64_t q = 0; q < n; q++) eid[q] = (int64_t)(next_u64() % (E + 1)) - 1;
    for (int64_t t = 0; t < T; t++) {
        aid[t] = (int64_t)(next_u64() % 4) - 1;
        ps[t] = t % 4 == 2 ? 0.0 : 0.5 + uniform();
        eid[t * K + 1] = eid[t * K]; /* a token visiting one expert twice */
    }
    snprintf(g_what, sizeof g_what, "experts out=%s %s rows=%lld cols=%lld T=%lld threads=%d",
             DT[ot], shared ? "shared x" : "x per slot", (long long)rows, (long long)cols,
             (long long)T, threads);
    const int64_t xe = shared ? K : 1;
    for (int pass = 0; pass < 2; pass++) {
        lora_set_num_threads(pass ? 2 : threads);
        void *dst = pass ? two : got;
        memcpy(dst, out0, ob);
        CHECK(apply_experts_(2 * E + 1, first, dp, sc, 3, starts, E, aid, ps, K, eid, xe, rows,
                                 cols, n, x, LORA_DTYPE_BF16, cols, dst, ot, rows, &bad) == LORA_OK,
              "status");
    }
    CHECK(same_bits(got, two, no, ot), "1 thread and 2 threads differ");
    for (int64_t q = 0; q < n; q++) {
        const int64_t t = q / K, a = aid[t], e = eid[q];
        memcpy(row, (char *)out0 + q * rows * osz, (size_t)rows * osz);
        if (a >= 0 && e >= 0 && a != 1) {
            const int64_t k = starts[a] + e, f[2] = {0, 1};
            apply_batch_(1, f, dp + first[k], sc + first[k], NULL, ps + t, 1, rows, cols, 1,
                             (char *)x + (q / xe) * cols * 2, LORA_DTYPE_BF16, cols, row, ot, rows,
                             &bad);
        }
        CHECK(same_bits(row, (char *)got + q * rows * osz, rows, ot),
              "pair %lld (adapter %lld, expert %lld) differs from the expert alone", (long long)q,
              (long long)a, (long long)e);
    }
    /* refusals: nothing written, the position named */
    memcpy(got, out0, ob);
    eid[n - 1] = E;
    CHECK(apply_experts_(2 * E + 1, first, dp, sc, 3, starts, E, aid, ps, K, eid, xe, rows, cols,
                             n, x, LORA_DTYPE_BF16, cols, got, ot, rows, &bad) == LORA_ERR_INDEX &&
              bad == n - 1, "expert id E: status / bad %lld", (long long)bad);
    eid[n - 1] = -1;
    aid[T - 1] = 3;
    CHECK(apply_experts_(2 * E + 1, first, dp, sc, 3, starts, E, aid, ps, K, eid, xe, rows, cols,
                             n, x, LORA_DTYPE_BF16, cols, got, ot, rows, &bad) == LORA_ERR_ADAPTER &&
              bad == T - 1, "adapter id 3: status / bad %lld", (long long)bad);
    CHECK(same_bits(got, out0, no, ot), "a refused experts call wrote out");
    lora_set_num_threads(0);
    free(xw), free(x), free(ow), free(out0), free(got), free(two), free(row), free(eid);
    for (int q = 0; q < 2 * E; q++) free_delta(&m[q]);
}

/* every entry point refuses a dtype code outside the registry with LORA_ERR_DTYPE (the
 * constructors with NULL) and writes nothing; merge and abs-max report through their
 * out-parameters */
static void check_statuses(void) {
    snprintf(g_what, sizeof g_what, "statuses");
    const float a[2] = {1.0f, 2.0f}, b[3] = {1.0f, -1.0f, 0.5f};
    lora_delta *d = lora_delta_new(LORA_FMT_F32, LORA_FMT_F32, 1, 3, 2, a, b);
    CHECK(d != NULL, "lora_delta_new");
    const int bad_codes[2] = {-1, LORA_DTYPE_COUNT}, bad_formats[2] = {-1, LORA_FMT_COUNT};
    float x[2] = {1.0f, 1.0f}, out[3] = {0.0f, 0.0f, 0.0f};
    int64_t ids[1] = {0}, bad = 7;
    const int64_t first[2] = {0, 1};
    const lora_delta *dp[1] = {d};
    const double sc[1] = {1.0};
    for (int c = 0; c < 2; c++) {
        const int dt = bad_codes[c];
        const int bf = bad_formats[c];
        CHECK(lora_delta_new(bf, bf, 1, 3, 2, a, b) == NULL, "lora_delta_new(format %d)", bf);
        CHECK(lora_delta_new(LORA_FMT_F32, bf, 1, 3, 2, a, b) == NULL, "lora_delta_new(B format %d)", bf);
        CHECK(lora_delta_view(bf, 1, 3, 2, a, 2, 0, b, 3, 0) == NULL, "lora_delta_view(format %d)", bf);
        CHECK(add_(d, 1.0f, x, dt, out, LORA_DTYPE_F32) == LORA_ERR_DTYPE, "add x dtype %d", dt);
        CHECK(add_(d, 1.0f, x, LORA_DTYPE_F32, out, dt) == LORA_ERR_DTYPE, "add out dtype %d", dt);
        CHECK(apply_batch_(1, first, dp, sc, NULL, NULL, 1, 3, 2, 1, x, dt, 2, out, LORA_DTYPE_F32, 3,
                               &bad) == LORA_ERR_DTYPE, "apply x dtype %d", dt);
        CHECK(add_rows_(d, 1.0f, 1, ids, out, dt, 2, &bad) == LORA_ERR_DTYPE, "rows dtype %d", dt);
        double m = 5.0;
        CHECK(lora_abs_max(out, dt, 3, 1, 3, &m) == LORA_ERR_DTYPE, "lora_abs_max dtype %d", dt);
        const double ad[2] = {1.0, 1.0}, bd[3] = {1.0, 1.0, 1.0};
        const double *ap[1] = {ad}, *bp[1] = {bd};
        const int64_t ranks[1] = {1};
        CHECK(lora_merge(out, dt, 3, 1, 3, 1, ap, bp, ranks, sc, 1, &bad) == LORA_ERR_DTYPE && bad == -1,
              "lora_merge dtype %d", dt);
    }
    CHECK(out[0] == 0.0f && out[1] == 0.0f && out[2] == 0.0f, "a refused call wrote out");
    /* a view reads caller's rows of values: no block format */
    CHECK(lora_delta_view(LORA_FMT_Q8_0, 1, 3, 2, a, 32, 0, b, 32, 0) == NULL, "a Q8_0 view");
    /* abs-max and merge on every dtype: statuses and results */
    for (int dt = 0; dt < LORA_DTYPE_COUNT; dt++) {
        snprintf(g_what, sizeof g_what, "abs_max / merge w=%s", DT[dt]);
        const float wv[6] = {0.5f, -3.0f, 2.0f, 1.0f, -0.25f, 0.0f};
        unsigned char w[6 * 4];
        for (int i = 0; i < 6; i++) lora_store_f32(w, i, wv[i], dt);
        double m = 0.0;
        CHECK(lora_abs_max(w, dt, 3, 2, 3, &m) == LORA_OK && m == 3.0, "abs max %g, want 3", m);
        CHECK(lora_abs_max(w, dt, 2, 2, 3, &m) == LORA_ERR_ARG, "ldw < cols accepted");
        /* w += 2 * (B A) with A = [1 1 1], B = [1; -1]: row 0 + 2, row 1 - 2 */
        const double ad[3] = {1.0, 1.0, 1.0}, bd[2] = {1.0, -1.0}, s2[1] = {2.0};
        const double *ap[1] = {ad}, *bp[1] = {bd};
        const int64_t ranks[1] = {1};
        CHECK(lora_merge(w, dt, 3, 2, 3, 1, ap, bp, ranks, s2, 0, &bad) == LORA_OK && bad == -1,
              "check pass: status or bad %lld", (long long)bad);
        CHECK(lora_merge(w, dt, 3, 2, 3, 1, ap, bp, ranks, s2, 1, &bad) == LORA_OK && bad == -1,
              "write pass: status or bad %lld", (long long)bad);
        int ok = 1;
        for (int i = 0; i < 6; i++) ok &= lora_load_f32(w, i, dt) == wv[i] + (i < 3 ? 2.0f : -2.0f);
        CHECK(ok, "merged values");
        /* an element pushed past the largest finite value: its flat index, nothing written */
        const double huge[1] = {1e39};
        CHECK(lora_merge(w, dt, 3, 2, 3, 1, ap, bp, ranks, huge, 0, &bad) == LORA_OK && bad == 0,
              "overflow check: bad %lld, want 0", (long long)bad);
    }
    lora_delta_free(d);
}

/* ------------------------------------------------------------------ main */

int main(void) {
    static const int64_t SIZES[] = {1, 7, 15, 16, 17, 31, 32, 33, 129};
    const int nsizes = (int)(sizeof SIZES / sizeof SIZES[0]);
    const int best = lora_best_isa();
    printf("check_kernels: best path %s, openmp %d, threads %d, %s\n", ISA_NAME[best], lora_openmp(),
           lora_get_num_threads(), lora_compiler());
    if (lora_openmp()) {
        lora_set_num_threads(2);
        const int team = lora_probe_threads();
        lora_set_num_threads(0);
        snprintf(g_what, sizeof g_what, "setup");
        CHECK(team >= 2, "an OpenMP build gets a team of %d (set OMP_NUM_THREADS=2): the thread "
              "checks would be vacuous", team);
    }
    check_statuses();
    for (int isa = 0; isa < LORA_ISA_COUNT; isa++) {
        if (!lora_isa_supported(isa)) continue;
        set_isa(isa);
        g_isa = ISA_NAME[isa];
        const long before = g_pass + g_fail, failed = g_fail;
        for (int fmt = 0; fmt < LORA_FMT_COUNT; fmt++)
            for (int dim = 0; dim < 3; dim++)
                for (int s = 0; s < nsizes; s++) {
                    int64_t r[3] = {8, 24, 40}; /* rank, rows, cols */
                    r[dim] = SIZES[s];
                    check_shape(isa, fmt, r[0], r[1], r[2], 6);
                }
        for (int s = 0; s < nsizes; s++) check_q8_0_is_f32(1 + SIZES[s] % 20, SIZES[s] + 16, SIZES[s] * 3);
        check_q8_0_is_f32(17, 300, 4113);
        for (int ot = 0; ot < LORA_DTYPE_COUNT; ot++) {
            /* above the parallel threshold: prefill, decode (team splits one block) */
            check_threads_batch(ot == 0 ? LORA_DTYPE_F32 : ot, ot, 33, 1001, 1003, 9);
            check_threads_batch(ot == 2 ? LORA_DTYPE_F32 : LORA_DTYPE_BF16, ot, 64, 1100, 1100, 1);
            check_threads_batch(LORA_FMT_Q8_0, ot, 48, 1100, 1003, ot == 1 ? 1 : 9);
            check_stack_and_bank(ot, 40, 33, 13, 1);
            check_stack_and_bank(ot, 1001, 257, 11, 2);
            check_experts(ot, 1, 33, 17, 7, 1);
            check_experts(ot, 0, 129, 65, 5, 1);
            check_experts(ot, 1, 600, 500, 21, 2);   /* above the parallel threshold */
        }
        check_rounding(LORA_DTYPE_F16);
        check_rounding(LORA_DTYPE_BF16);
        printf("  %-7s %ld checks, %ld failed\n", g_isa, g_pass + g_fail - before, g_fail - failed);
    }
    printf("check_kernels: %ld passed, %ld failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
