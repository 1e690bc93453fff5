/*
 * kernels_read.h - the benchmark's two probes of the SIMD paths (see
 * bench.c), whose speed matters and never their bits:
 *   read_   the bandwidth probe (lora_read_<isa>): the sum of n floats
 *           through the ISA's widest loads, four independent vector adds in
 *           flight (enough to keep two load ports busy from L1), the four
 *           sums reduced by the ISA's horizontal sum, then a scalar tail;
 *   peak_   the compute probe (lora_peak_<isa>): n steps of PEAK_CHAINS_
 *           independent fused multiply-adds on the ISA's vectors, with no
 *           memory traffic: how many float32 flops a thread of this core
 *           retires, whatever its FMA ports, their width (Zen 4 runs a
 *           512-bit FMA on 256-bit units) or its clock.
 *
 * Included by an ISA file inside its target region, after it has defined
 * INLINE_ and this vocabulary:
 *   READ_F32V_         the vector type        READ_LANES_     its float lanes
 *   read_zero_()       a zero vector          read_load_(p)   an unaligned load
 *   read_add_(a, b)    lane-wise add          read_hsum_(v)   the sum of the lanes
 *   read_set1_(f)      f in every lane        read_fma_(a, b, c)  a * b + c, fused
 * No include guard: every file compiles its own copy for its target.
 */

INLINE_ double read_(const float *buf, int64_t n) {
    READ_F32V_ s0 = read_zero_(), s1 = s0, s2 = s0, s3 = s0;
    int64_t j = 0;
    for (; j + 4 * READ_LANES_ <= n; j += 4 * READ_LANES_) {
        s0 = read_add_(s0, read_load_(buf + j));
        s1 = read_add_(s1, read_load_(buf + j + READ_LANES_));
        s2 = read_add_(s2, read_load_(buf + j + 2 * READ_LANES_));
        s3 = read_add_(s3, read_load_(buf + j + 3 * READ_LANES_));
    }
    double s = read_hsum_(read_add_(read_add_(s0, s1), read_add_(s2, s3)));
    for (; j < n; j++) s += buf[j];
    return s;
}

/* chains in flight: latency x ports of the widest FMA seen (4 cycles x 2
 * ports) plus room, within AVX2's 16 registers (12 + the two constants) */
#define PEAK_CHAINS_ 12

INLINE_ double peak_(int64_t n, int64_t *flops) {
    /* a <- a / 2 + 1/2 reaches exactly 1 within ~30 steps and stays: no overflow,
     * no subnormals, and a checksum of exactly the lane count */
    const READ_F32V_ m = read_set1_(0.5f), c = read_set1_(0.5f);
    READ_F32V_ a[PEAK_CHAINS_];
    for (int i = 0; i < PEAK_CHAINS_; i++) a[i] = read_set1_((float)i);
    for (int64_t s = 0; s < n; s++)
        for (int i = 0; i < PEAK_CHAINS_; i++) a[i] = read_fma_(a[i], m, c);
    READ_F32V_ sum = a[0];
    for (int i = 1; i < PEAK_CHAINS_; i++) sum = read_add_(sum, a[i]);
    *flops = n * PEAK_CHAINS_ * READ_LANES_ * 2;
    return read_hsum_(sum);
}
