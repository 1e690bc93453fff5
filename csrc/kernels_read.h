/*
 * kernels_read.h - the benchmark's bandwidth probe (lora_read_<isa>, see
 * bench.c) of the SIMD paths: the sum of n floats through the ISA's widest
 * loads, four independent vector adds in flight (enough to keep two load
 * ports busy from L1), the four sums reduced by the ISA's horizontal sum,
 * then a scalar tail.  Only its speed matters, never its bits.
 *
 * Included by an ISA file inside its target region, after it has defined
 * INLINE_ and this vocabulary:
 *   READ_F32V_         the vector type        READ_LANES_     its float lanes
 *   read_zero_()       a zero vector          read_load_(p)   an unaligned load
 *   read_add_(a, b)    lane-wise add          read_hsum_(v)   the sum of the lanes
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
