/* Integer linear layers for x86-64 CPUs: the "int8" arithmetic (trserve, engine/model/kernels/).
 *
 * y[n, O] = x[n, I] @ W^T (+ bias), W the same 4-bit (q4: q * d + m), 5-bit (q5: q * d + m) or 8-bit
 * (q8: q * d) blocks of 32
 * as qlinear.c reads, x quantized per row and block of 32 inputs to int8:
 *   amax = max |x[32b + j]|;  s = amax / 127;  xq[j] = clamp(rne(x[32b + j] * (127 / amax)), -127, 127)
 *   (all zero, s = 0, where 127 / amax is not finite);  c = sum_j xq[j] (an integer);  xm = (float)c * s
 * Then per output o and block b, an exact integer dot product of the codes with xq, and the float part
 * in one fixed order:
 *   acc = 0;  for b in order:  f = (float)isum(o, b) * s_b;  acc = fma(f, d[o, b], acc);
 *                              kinds with a min (qlinear.h): acc = fma(m[o, b], xm_b, acc)
 *   y = acc (+ bias[o])
 * Kinds 18 and 17 (a scale per 16 inputs) split each block's integer sum in its halves, each with its
 * scale:
 *   acc = fma((float)isum_lo * s_b, d[o, 2b], acc);  acc = fma((float)isum_hi * s_b, d[o, 2b + 1], acc)
 * d and m are the kind's scales as floats (qlinear.h: v_scale, v_min; the two-level kinds' d16 * sc and
 * -(dmin16 * mn), exact), so the two-level kinds give their float32 reference kinds' bits.
 * isum is exact (|isum| <= 32 * 255 * 127 < 2^24, so its float is exact too); the float ops are the
 * same IEEE operations in every build. So a row's outputs are the same bits alone or in a batch of any
 * width, and the same bits on the avx512vnni, avx512, avx2 and scalar builds: only how the integer
 * products are formed differs (vpdpbusd; vpmaddubsw + vpmaddwd; scalar), never their sum.
 *
 * Weight layout (pack.py: pack_q4_i8, pack_q8_i8), panels of 16 outputs, one 32-bit lane per output
 * holding 4 consecutive inputs' codes, as vpdpbusd takes them:
 *   q4: 4 chunks of 64 bytes per panel-block; chunk h byte [4l + k] = q[16p + l, 32b + 8h + k] |
 *       q[16p + l, 32b + 8h + 4 + k] << 4 (low nibbles: inputs 8h..8h+3, high: 8h+4..8h+7)
 *   q5 (kind 12, codes 0..31): q4's 4 chunks of the codes' low nibbles, then a 64-byte plane of their
 *       high bits (bit 4), in one of two layouts, the same builds as the exact arithmetic's q4 layouts
 *       (ilanes.h: Q5_MASKS; the loader packs the one trserve_qlinear_q4_layout names):
 *       "masks" (avx512, scalar; "bytes"): per chunk h 16 bytes, two little-endian uint64 masks of its
 *         64 code bytes, [16h, 16h + 8) bit 4l + k = q[16p + l, 32b + 8h + k] >> 4 (the lo bytes), then
 *         [16h + 8, 16h + 16) bit 4l + k = q[16p + l, 32b + 8h + 4 + k] >> 4 (hi): a zero-masked move of
 *         0x10s each, or-ed in by the vpternlogd that masks the nibbles
 *       "shifts" (avx2; "lanes"): byte [4l + k] bit h = q[16p + l, 32b + 8h + k] >> 4 and bit 4 + h =
 *         q[16p + l, 32b + 8h + 4 + k] >> 4 (h = 0..3): chunk h's high bits lane-aligned with its nibble
 *         bytes, put at bit 4 by a 16-bit shift (left 4 - h; right h) and a mask
 *       a panel-block is 320 contiguous bytes
 *   q8: 8 groups of 64 bytes; group g byte [4l + k] = q[16p + l, 32b + 4g + k] + 128 (biased, unsigned)
 *   d, m: as qlinear.c (16 halves per panel-block; the two-level kinds' records per super-block)
 * The unsigned operand of vpdpbusd is the q4 code (0..15) or the biased q8 code (0..255); the signed
 * one the activations. q8's bias is taken back out exactly: the block's accumulators start at
 * -128 * c. Without VNNI, vpmaddubsw takes q4 codes as they are (2 * 15 * 127 cannot saturate int16;
 * a block's 8 such pairs per int16 lane sum to at most 30480), q5 codes likewise (2 * 31 * 127), their
 * int16 sums widened to int32 every two chunks (4 pairs: 31496 < 32768; a block's 8 would overflow),
 * and q8 codes as |w| against sign(x, w) (2 * 128 * 127 cannot saturate either).
 *
 * Each tile of R rows x T panels unpacks a panel-block's codes once for all its rows.
 *
 * Kept inputs (outliers): a fixed set of input dims per layer input (chosen once per model, never per
 * batch: engine/model/kernels/outliers.py) is quantized as zeros, so one large value does not coarsen
 * its block's scale, and added back in float32 after the integer part, in the set's order:
 *   y = fma(W[o, dims[j]], x[dims[j]], y) for j = 0 .. n_kept - 1
 * The same IEEE operations in every build, so the contract above holds with them.
 */
#include "qlinear.h"
#include "pool.h"
#include "vec.h"
#include "ilanes.h"

void quant_rows(const float *x, int64_t n, int64_t I, qact_t *a, const int32_t *dims, int64_t n_dims)
{
    const int64_t nb = I / 32;
    a->n_kept = n_dims;
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * I;
        if (n_dims) { /* the kept inputs aside, quantized as zeros */
            memcpy(a->row, xr, I * sizeof(float));
            for (int64_t j = 0; j < n_dims; j++) {
                a->kept[r * n_dims + j] = xr[dims[j]];
                a->row[dims[j]] = 0.0f;
            }
            xr = a->row;
        }
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k = b * n + r;
            int32_t c;
            quant_block(xr + 32 * b, a->q + 32 * k, a->s + k, &c);
            a->m[k] = (float)c * a->s[k];
            a->c[k] = -128 * c;
            if (a->c16) {
                int32_t lo = 0;
                for (int i = 0; i < 16; i++) lo += a->q[32 * k + i];
                a->c16[k] = -128 * lo;
            }
        }
    }
}

/* y[r, o] += sum_j kept_w[j, o] x[r, dims[j]] for outputs [o0, o1) of every row, one fma per j in order. */
static void add_kept(const qmat_t *w, const qact_t *a, float *y, int64_t o0, int64_t o1)
{
    const int64_t K = w->n_kept, O = w->out;
    for (int64_t r = 0; r < a->n; r++) {
        float *yr = y + r * O;
        const float *xk = a->kept + r * K;
        int64_t o = o0;
        for (; o + 16 <= o1; o += 16) {
            v16 acc = v_load(yr + o);
            for (int64_t j = 0; j < K; j++) acc = v_fma(v_load(w->kept_w + j * O + o), xk + j, acc);
            v_store(yr + o, acc);
        }
        for (; o < o1; o++)
            for (int64_t j = 0; j < K; j++) yr[o] = fmaf(w->kept_w[j * O + o], xk[j], yr[o]);
    }
}

/* ---- tiles ------------------------------------------------------------------------------------ */
#define IBLOCK_BYTES(kind) (KQ6(kind) ? 384 : KQ5(kind) ? 320 : KQ4(kind) ? 256 : 512) /* a panel-block's codes */

#if defined(__AVX512F__) || defined(__AVX2__)
/* Rows [r0, r0 + R) x panels [p, p + T): per block, the codes unpacked once for the tile's rows. */
INLINE void itile(const qmat_t *w, const int kind, const int R, const int T, const qact_t *a, float *y, int64_t p,
                  int64_t r0)
{
    const int64_t nb = w->nb, n = a->n;
    v16 acc[MAX_ROWS][MAX_PANELS];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = v_zero();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xb = a->q + (b * n + r0) * 32; /* row r's block at xb + 32 r */
        const float *xs = a->s + b * n + r0, *xm = a->m + b * n + r0;
        const int32_t *xc = a->c + b * n + r0, *xc16 = KH16(kind) ? a->c16 + b * n + r0 : xc;
        const uint8_t *c[MAX_PANELS];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            c[t] = w->codes + IBLOCK_BYTES(kind) * ((p + t) * nb + b);
            const uint8_t *pc = c[t] + 2 * IBLOCK_BYTES(kind); /* two blocks ahead, into L2 */
            for (int l = 0; l < IBLOCK_BYTES(kind); l += 64) __builtin_prefetch(pc + l, 0, 2);
        }
        vi16 ia[MAX_ROWS][MAX_PANELS], ih[MAX_ROWS][MAX_PANELS]; /* ih: KH16 kinds' first half */
        if (KQ4(kind)) { /* without VNNI the products add up in 16 bits (q4: a block's 16 <= 16 x 15 x 127;
                          * q5: two chunks' 8 <= 8 x 31 x 127, then widened) */
            a4_t s4[MAX_ROWS][MAX_PANELS];
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) /* q6: the codes' offset, -32 x the half's sum (-128 c16 / 4) */
                    s4[r][t] = a4_zero(), ia[r][t] = KQ6(kind) ? vi_set1(xc16[r] / 4) : vi_zero();
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) {
                vi16 lo[MAX_PANELS], hi[MAX_PANELS];
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    if (KQ6(kind)) wq6(c[t] + 64 * h, c[t] + 256, h, &lo[t], &hi[t]);
                    else if (KQ5(kind)) wq5(c[t] + 64 * h, c[t] + 256, h, &lo[t], &hi[t]);
                    else wq4(c[t] + 64 * h, &lo[t], &hi[t]);
                }
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) {
                    const int32_t xl = x4(xb + 32 * r + 8 * h), xh = x4(xb + 32 * r + 8 * h + 4);
#pragma GCC unroll 4
                    for (int t = 0; t < T; t++) s4[r][t] = a4_dp(a4_dp(s4[r][t], lo[t], xl), hi[t], xh);
                }
                /* the int16 sums widened (VNNI: int32 already): q5 every two chunks, q6 every chunk (2 x 2 x 63 x 127) */
                if (h == 3 || (KQ5(kind) && A4_I16 && h == 1) || (KQ6(kind) && (A4_I16 || h == 1)))
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                        for (int t = 0; t < T; t++) ia[r][t] = vi_add(ia[r][t], a4_sum(s4[r][t])), s4[r][t] = a4_zero();
                if (KQ6(kind) && h == 1) /* the first half (inputs 0..15) done: the second's sums start afresh */
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                        for (int t = 0; t < T; t++) ih[r][t] = ia[r][t], ia[r][t] = vi_set1((xc[r] - xc16[r]) / 4);
            }
        } else {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) ia[r][t] = Q8_BIAS ? vi_set1(KH16(kind) ? xc16[r] : xc[r]) : vi_zero();
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                if (KH16(kind) && g == 4) /* the second half's sums start afresh (its share of the bias) */
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                        for (int t = 0; t < T; t++) {
                            ih[r][t] = ia[r][t];
                            ia[r][t] = Q8_BIAS ? vi_set1(xc[r] - xc16[r]) : vi_zero();
                        }
                w8_t wg[MAX_PANELS];
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) wg[t] = w8(c[t] + 64 * g);
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) {
                    const int32_t xg = x4(xb + 32 * r + 4 * g);
#pragma GCC unroll 4
                    for (int t = 0; t < T; t++) ia[r][t] = dp8(ia[r][t], wg[t], xg);
                }
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const int64_t pb = (p + t) * nb + b;
            const v16 vd = v_scale(w->d, kind, pb, 0), vm = KMIN(kind) ? v_min_of(w->m, kind, pb, vd) : v_zero();
            const v16 vd2 = KH16(kind) ? v_scale(w->d, kind, pb, 1) : vd;
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                if (KH16(kind)) {
                    acc[r][t] = v_fmav(v_mul(vi_float(ih[r][t]), xs + r), vd, acc[r][t]);
                    acc[r][t] = v_fmav(v_mul(vi_float(ia[r][t]), xs + r), vd2, acc[r][t]);
                } else {
                    acc[r][t] = v_fmav(v_mul(vi_float(ia[r][t]), xs + r), vd, acc[r][t]);
                }
                if (KMIN(kind)) acc[r][t] = v_fma(vm, xm + r, acc[r][t]);
            }
        }
    }
    store_tile(w, R, T, acc, y, p, r0);
}
#endif

INLINE float half1(uint16_t h)
{
#if defined(__AVX512F__) || defined(__AVX2__)
    return _cvtsh_ss(h);
#else
    return half_to_float(h);
#endif
}

/* Output l's scale of panel-block pb (h: a KH16 kind's half) as a float: v_scale's lane l. */
INLINE float scale1(const uint16_t *s, int kind, int64_t pb, int h, int l)
{
    if (KF16(kind)) return half1(s[PANEL * pb + l]);
    if (KTWO(kind)) {
        uint16_t d16;
        memcpy(&d16, k_record(s, kind, pb) + 2 * l, sizeof d16);
        const uint8_t sc = k_sub(s, kind, pb, h)[l];
        return half1(d16) * (KH16(kind) ? (float)(int8_t)sc : (float)sc);
    }
    return ((const float *)s)[PANEL * (KH16(kind) ? 2 * pb + h : pb) + l];
}
/* Output l's min of panel-block pb: v_min_of's lane l. */
INLINE float min1(const uint16_t *m, const uint16_t *d, int kind, int64_t pb, int l)
{
    if (!m) return (KQ5(kind) ? -16.0f : -8.0f) * scale1(d, kind, pb, 0, l); /* v_min_of's implied min */
    return KTWO(kind) ? -scale1(m, kind, pb, 0, l) : scale1(m, kind, pb, 0, l);
}

/* The code of output l of a panel-block c (int8 layout), input i of the block: its weight's integer. */
INLINE int32_t icode(const uint8_t *c, int kind, int l, int i)
{
    if (KQ4(kind)) {
        const uint8_t byte = c[64 * (i / 8) + 4 * l + i % 4];
        const int32_t q = i % 8 < 4 ? byte & 0xF : byte >> 4;
        if (!KQ5(kind) && !KQ6(kind)) return q;
#if Q5_MASKS /* chunk i / 8's lo mask, then its hi mask: bit 4l + i % 4 */
        const int bit = 4 * l + i % 4, at = 16 * (i / 8) + 8 * (i % 8 >= 4) + bit / 8;
        const int32_t q5 = q | ((c[256 + at] >> (bit % 8)) & 1) << 4;
        return KQ6(kind) ? (q5 | ((c[320 + at] >> (bit % 8)) & 1) << 5) - 32 : q5; /* q6: the code less its offset */
#else /* byte [4l + i % 4], bit i / 8 (inputs 8h..8h+3) or 4 + i / 8 (8h+4..8h+7) */
        const int at = 4 * l + i % 4, bit = i % 8 < 4 ? i / 8 : 4 + i / 8;
        const int32_t q5 = q | ((c[256 + at] >> bit) & 1) << 4;
        return KQ6(kind) ? (q5 | ((c[320 + at] >> bit) & 1) << 5) - 32 : q5;
#endif
    }
    return (int32_t)c[64 * (i / 4) + 4 * l + i % 4] - 128;
}

/* Any tile, output by output, in plain C (the scalar build's; the vector builds' check): the same
 * integers, and the same float operations in the same order, as itile. */
static void itile_any(const qmat_t *w, int R, int T, const qact_t *a, float *y, int64_t p, int64_t r0)
{
    const int64_t nb = w->nb, n = a->n;
    const int kind = w->kind, halves = KH16(kind) ? 2 : 1;
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float out[PANEL];
            for (int l = 0; l < PANEL; l++) {
                float s = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const int64_t pb = (p + t) * nb + b, k = b * n + r0 + r;
                    const uint8_t *c = w->codes + IBLOCK_BYTES(kind) * pb;
                    const int8_t *xq = a->q + 32 * k;
                    for (int h = 0; h < halves; h++) {
                        int32_t isum = 0;
                        if (!KQ4(kind) && Q8_BIAS) isum = KH16(kind) ? (h ? a->c[k] - a->c16[k] : a->c16[k]) : a->c[k];
                        for (int i = 32 * h / halves; i < 32 * (h + 1) / halves; i++) isum += icode(c, kind, l, i) * xq[i];
                        const float f = (float)isum * a->s[k];
                        s = fmaf(f, scale1(w->d, kind, pb, h, l), s);
                    }
                    if (KMIN(kind)) s = fmaf(min1(w->m, w->d, kind, pb, l), a->m[k], s);
                }
                out[l] = s;
            }
            v16 one[MAX_ROWS][MAX_PANELS];
            one[0][0] = v_load(out);
            store_tile(w, 1, 1, one, y, p + t, r0 + r);
        }
}

/* Plans per ISA (register tiles; measured on the bundled model's shapes, bench/qlinear_isa.py):
 * one row takes I_ONE_PANELS panels; n <= I_NARROW_ROWS rows one tile of n x I_NARROW_PANELS; wider
 * batches tiles of I_WIDE_ROWS x I_WIDE_PANELS. They change which chains run side by side, never the
 * arithmetic of one. */
#if defined(__AVX512F__)
#define DEFAULT_I_ONE_PANELS 4
#define DEFAULT_I_NARROW_ROWS 4
#define DEFAULT_I_NARROW_PANELS 2
#define DEFAULT_I_WIDE_ROWS 6
#define DEFAULT_I_WIDE_PANELS 2
#elif defined(__AVX2__)
#define DEFAULT_I_ONE_PANELS 2
#define DEFAULT_I_NARROW_ROWS 2
#define DEFAULT_I_NARROW_PANELS 2
#define DEFAULT_I_WIDE_ROWS 4
#define DEFAULT_I_WIDE_PANELS 1
#else
#define DEFAULT_I_ONE_PANELS 1
#define DEFAULT_I_NARROW_ROWS 1
#define DEFAULT_I_NARROW_PANELS 1
#define DEFAULT_I_WIDE_ROWS 2
#define DEFAULT_I_WIDE_PANELS 1
#endif
#ifndef I_ONE_PANELS
#define I_ONE_PANELS DEFAULT_I_ONE_PANELS
#endif
#ifndef I_NARROW_ROWS
#define I_NARROW_ROWS DEFAULT_I_NARROW_ROWS
#endif
#ifndef I_NARROW_PANELS
#define I_NARROW_PANELS DEFAULT_I_NARROW_PANELS
#endif
#ifndef I_WIDE_ROWS
#define I_WIDE_ROWS DEFAULT_I_WIDE_ROWS
#endif
#ifndef I_WIDE_PANELS
#define I_WIDE_PANELS DEFAULT_I_WIDE_PANELS
#endif
#if I_NARROW_ROWS > 8 || I_WIDE_ROWS > 8 || I_ONE_PANELS > MAX_PANELS || I_NARROW_PANELS > MAX_PANELS \
    || I_WIDE_PANELS > MAX_PANELS
#error "int8 tiles: at most 8 rows x 4 panels"
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
/* Each tile shape the plans take its own function (constant R, T: accumulators in registers): R = 1..8
 * rows of 1 or 2 panels, one row of 4. */
#define ITILE_FN(K, R, T)                                                                                        \
    static __attribute__((noinline)) void itile_##K##_##R##_##T(const qmat_t *w, const qact_t *a, float *y,      \
                                                              int64_t p, int64_t r0) { itile(w, K, R, T, a, y, p, r0); }
#define ITILE_FNS(K, T) ITILE_FN(K, 1, T) ITILE_FN(K, 2, T) ITILE_FN(K, 3, T) ITILE_FN(K, 4, T) ITILE_FN(K, 5, T) \
    ITILE_FN(K, 6, T) ITILE_FN(K, 7, T) ITILE_FN(K, 8, T)
#define ITILE_KIND(K) ITILE_FNS(K, 1) ITILE_FNS(K, 2) ITILE_FN(K, 1, 4)
ITILE_KIND(4) ITILE_KIND(8) ITILE_KIND(6) ITILE_KIND(10) ITILE_KIND(18) ITILE_KIND(9) ITILE_KIND(12) ITILE_KIND(20) ITILE_KIND(22)
ITILE_FN(5, 1, 1) ITILE_FN(17, 1, 1) /* the reference kinds: one row, one panel (imat_rows) */
#undef ITILE_KIND
#undef ITILE_FNS
#undef ITILE_FN
#endif

static void itile_call(const qmat_t *w, int R, int T, const qact_t *a, float *y, int64_t p, int64_t r0)
{
#if defined(__AVX512F__) || defined(__AVX2__)
#define IC(K, RR, TT) if (w->kind == K && R == RR && T == TT) { itile_##K##_##RR##_##TT(w, a, y, p, r0); return; }
#define ICS(K, TT) IC(K, 1, TT) IC(K, 2, TT) IC(K, 3, TT) IC(K, 4, TT) IC(K, 5, TT) IC(K, 6, TT) IC(K, 7, TT) \
    IC(K, 8, TT)
#define ICK(K) ICS(K, 1) ICS(K, 2) IC(K, 1, 4)
    ICK(4) ICK(8) ICK(6) ICK(10) ICK(18) ICK(9) ICK(12) ICK(20) ICK(22) IC(5, 1, 1) IC(17, 1, 1)
#undef ICK
#undef ICS
#undef IC
    if (T > 1) { /* a shape not compiled (-D plans): its panels one by one, the same numbers */
        for (int t = 0; t < T; t++) itile_call(w, R, 1, a, y, p + t, r0);
        return;
    }
#endif
    itile_any(w, R, T, a, y, p, r0);
}

/* Panels [p0, p1) by T (single panels at the end), row tiles of RR rows (the last one ragged). */
static void ipart(const qmat_t *w, int RR, int T, const qact_t *a, float *y, int64_t p0, int64_t p1)
{
    const int64_t n = a->n;
    int64_t p = p0;
    for (; p + T <= p1; p += T)
        for (int64_t r0 = 0; r0 < n; r0 += RR) itile_call(w, n - r0 < RR ? (int)(n - r0) : RR, T, a, y, p, r0);
    for (; p < p1; p++)
        for (int64_t r0 = 0; r0 < n; r0 += RR) itile_call(w, n - r0 < RR ? (int)(n - r0) : RR, 1, a, y, p, r0);
}

void imat_rows(const qmat_t *w, const qact_t *a, float *y, int64_t id, int64_t nt, int64_t *o0, int64_t *o1)
{
    const int64_t panels = (w->out + PANEL - 1) / PANEL, p0 = panels * id / nt, p1 = panels * (id + 1) / nt;
    *o0 = PANEL * p0 < w->out ? PANEL * p0 : w->out;
    *o1 = PANEL * p1 < w->out ? PANEL * p1 : w->out;
    if (p1 <= p0 || a->n <= 0) return;
    if (KREF(w->kind)) ipart(w, 1, 1, a, y, p0, p1); /* the reference kinds: one row, one panel at a time */
    else if (a->n == 1) ipart(w, 1, I_ONE_PANELS, a, y, p0, p1);
    else if (a->n <= I_NARROW_ROWS) ipart(w, (int)a->n, I_NARROW_PANELS, a, y, p0, p1);
    else ipart(w, I_WIDE_ROWS, I_WIDE_PANELS, a, y, p0, p1);
    if (w->n_kept) add_kept(w, a, y, *o0, *o1);
}

int qact_alloc(qact_t *a, int64_t n, int64_t I)
{
    const int64_t k = n * (I / 32) + 1;
    a->n = n, a->n_kept = 0;
    a->q = malloc(32 * k), a->s = malloc(sizeof(float) * k), a->m = malloc(sizeof(float) * k);
    a->c = malloc(sizeof(int32_t) * k), a->c16 = malloc(sizeof(int32_t) * k);
    a->kept = malloc(sizeof(float) * (n * MAX_KEPT + 1)), a->row = malloc(sizeof(float) * (I + 1));
    return a->q && a->s && a->m && a->c && a->c16 && a->kept && a->row ? 0 : -1;
}

void qact_free(qact_t *a) { free(a->q), free(a->s), free(a->m), free(a->c), free(a->c16), free(a->kept), free(a->row); }

typedef struct {
    const qmat_t *w;
    const qact_t *a;
    float *y;
} ilinear_job_t;

static void ilinear_job(void *arg, int64_t id, int64_t nt)
{
    const ilinear_job_t *j = arg;
    int64_t o0, o1;
    imat_rows(j->w, j->a, j->y, id, nt, &o0, &o1);
}

/* As trserve_qlinear, in the int8 arithmetic: x [n, I] quantized here, codes in the int8 layout
 * (the top comment), the inputs dims [n_dims] kept in float32 (kept_w [n_dims, O]). 0, -1 without
 * memory, -2 when n_dims is above MAX_KEPT. */
int trserve_qlinear_i8_kept(int kind, const float *x, int64_t n, int64_t I, int64_t O, const uint8_t *codes,
                            const uint16_t *d, const uint16_t *m, const float *bias, const int32_t *dims,
                            int64_t n_dims, const float *kept_w, float *y, int threads)
{
    if (n_dims < 0 || n_dims > MAX_KEPT) return -2;
    if (!KNOWN_KIND(kind) || (KTWO(kind) && I % 256)) return -3;
    const qmat_t w = {kind, I, O, I / 32, codes, d, m, bias, n_dims, kept_w};
    qact_t a;
    int rc = -1;
    if (!qact_alloc(&a, n, I)) {
        quant_rows(x, n, I, &a, dims, n_dims);
        ilinear_job_t job = {&w, &a, y};
        pool_run(ilinear_job, &job, threads);
        rc = 0;
    }
    qact_free(&a);
    return rc;
}

int trserve_qlinear_i8(int kind, const float *x, int64_t n, int64_t I, int64_t O, const uint8_t *codes,
                       const uint16_t *d, const uint16_t *m, const float *bias, float *y, int threads)
{
    return trserve_qlinear_i8_kept(kind, x, n, I, O, codes, d, m, bias, NULL, 0, NULL, y, threads);
}

/* The quantized activations of x [n, I] (tests): q [nb, n, 32] int8, s, m [nb, n] float, c [nb, n]
 * int32 (-128 times the block's code sum). 0, or -1 without memory. */
int trserve_quantize_rows(const float *x, int64_t n, int64_t I, int8_t *q, float *s, float *m, int32_t *c)
{
    qact_t a = {n, q, s, m, c, NULL, 0, NULL, NULL};
    quant_rows(x, n, I, &a, NULL, 0);
    return 0;
}
