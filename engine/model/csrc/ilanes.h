/* Integer lanes of the int8 arithmetic, one written-out version per ISA variant (trserve,
 * engine/model/csrc/): qlinear_i8.c's tiles (weights x activations) and forward.c's attention scores
 * (keys x queries, the keys laid out as a q8 panel-block). Also the block quantizer both use. The
 * contract (exact integer products, the same bits in every build) is qlinear_i8.c's, at its top.
 */
#ifndef TRSERVE_ILANES_H
#define TRSERVE_ILANES_H

#include "isa.h"
#include "vec.h"

/* ---- integer lanes ---------------------------------------------------------------------------
 * vi16: 16 int32 lanes (the 16 outputs of a panel, as v16); a weight group: 64 bytes, lane l's 4 bytes
 * are 4 consecutive inputs' codes of output l. a4_t: a q4 block's running products (VNNI: int32 lanes,
 * dp4 = vpdpbusd; else 2 int16 lanes per output, summed to int32 once per block by a4_sum); a4_dp:
 * acc += q4 group . x (4 signed bytes, every lane);
 * w8 / dp8: a q8 group prepared once per tile, then acc += group . x per row. Q8_BIAS: whether dp8
 * leaves the +128 bias in (accumulators then start at -128 c). wq5: wq4 of a q5 panel-block's chunk h,
 * its high bits (from its plane, qlinear_i8.c's layout comment; Q5_MASKS: which of its two layouts this
 * build reads) at bit 4 of each byte. A4_I16: whether a4_t
 * holds int16 lanes (without VNNI), which q5 codes fill in two chunks (4 x 2 x 31 x 127 = 31496). */
INLINE int32_t x4(const int8_t *x)
{
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}

#if defined(__AVX512F__)

typedef __m512i vi16;
INLINE vi16 vi_zero(void) { return _mm512_setzero_si512(); }
INLINE vi16 vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
INLINE v16 vi_float(vi16 v) { return _mm512_cvtepi32_ps(v); }
INLINE vi16 vi_add(vi16 a, vi16 b) { return _mm512_add_epi32(a, b); }
INLINE void wq4(const uint8_t *c, vi16 *lo, vi16 *hi)
{
    const __m512i v = _mm512_loadu_si512(c), mask = _mm512_set1_epi8(0x0F);
    *lo = _mm512_and_si512(v, mask);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
}
/* wq4 of a q5 panel-block's chunk h (c: the chunk) with its high bits from the "masks" plane: two
 * 64-bit masks (one bit per byte of lo, of hi) select 0x10s, or-ed in as the nibbles are masked (one
 * vpternlogd: (v & 0x0F) | bits). */
#define Q5_MASKS 1
INLINE void wq5(const uint8_t *c, const uint8_t *plane, const int h, vi16 *lo, vi16 *hi)
{
    const __m512i v = _mm512_loadu_si512(c), mask = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
    uint64_t kl, kh;
    memcpy(&kl, plane + 16 * h, 8), memcpy(&kh, plane + 16 * h + 8, 8);
    *lo = _mm512_ternarylogic_epi32(v, _mm512_maskz_mov_epi8((__mmask64)kl, b4), mask, 0xEC);
    *hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_maskz_mov_epi8((__mmask64)kh, b4), mask, 0xEC);
}
/* wq5 of a q6 panel-block's chunk h with bit 5 from the second plane (64 bytes after the first, the
 * same layout): 0x20s added where its masks say (the bytes hold 0 or 0x10 there: an or). */
INLINE void wq6(const uint8_t *c, const uint8_t *plane, const int h, vi16 *lo, vi16 *hi)
{
    const __m512i v = _mm512_loadu_si512(c), mask = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10),
                  b5 = _mm512_set1_epi8(0x20);
    uint64_t kl, kh, ml, mh;
    memcpy(&kl, plane + 16 * h, 8), memcpy(&kh, plane + 16 * h + 8, 8);
    memcpy(&ml, plane + 64 + 16 * h, 8), memcpy(&mh, plane + 64 + 16 * h + 8, 8);
    const __m512i bl = _mm512_maskz_mov_epi8((__mmask64)kl, b4), bh = _mm512_maskz_mov_epi8((__mmask64)kh, b4);
    *lo = _mm512_ternarylogic_epi32(v, _mm512_mask_add_epi8(bl, (__mmask64)ml, bl, b5), mask, 0xEC);
    *hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_mask_add_epi8(bh, (__mmask64)mh, bh, b5), mask, 0xEC);
}
#if defined(__AVX512VNNI__)
#define Q8_BIAS 1
typedef __m512i w8_t;
INLINE vi16 dp4(vi16 acc, vi16 u, int32_t x) { return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(x)); }
INLINE w8_t w8(const uint8_t *c) { return _mm512_loadu_si512(c); }
INLINE vi16 dp8(vi16 acc, w8_t u, int32_t x) { return dp4(acc, u, x); }
#else
#define Q8_BIAS 0
typedef struct { __m512i a; __mmask64 neg; } w8_t; /* |w|, and where w < 0 */
typedef __m512i a4_t; /* 32 int16 lanes: 2 per output */
INLINE a4_t a4_zero(void) { return _mm512_setzero_si512(); }
INLINE a4_t a4_dp(a4_t acc, vi16 u, int32_t x) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, _mm512_set1_epi32(x))); }
INLINE vi16 a4_sum(a4_t acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
INLINE w8_t w8(const uint8_t *c)
{
    const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(c), _mm512_set1_epi8((char)0x80));
    w8_t r = {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)};
    return r;
}
INLINE vi16 dp8(vi16 acc, w8_t w, int32_t x)
{
    const __m512i xv = _mm512_set1_epi32(x), sx = _mm512_mask_sub_epi8(xv, w.neg, _mm512_setzero_si512(), xv);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w.a, sx), _mm512_set1_epi16(1)));
}
#endif

#elif defined(__AVX2__)

typedef struct { __m256i a, b; } vi16; /* lanes 0..7, 8..15 */
INLINE vi16 vi_zero(void) { vi16 v = {_mm256_setzero_si256(), _mm256_setzero_si256()}; return v; }
INLINE vi16 vi_set1(int32_t x) { vi16 v = {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; return v; }
INLINE v16 vi_float(vi16 x) { v16 v = {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; return v; }
INLINE vi16 vi_add(vi16 x, vi16 y) { vi16 v = {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; return v; }
INLINE void wq4(const uint8_t *c, vi16 *lo, vi16 *hi)
{
    const __m256i va = _mm256_loadu_si256((const __m256i *)c), vb = _mm256_loadu_si256((const __m256i *)(c + 32));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    lo->a = _mm256_and_si256(va, mask), lo->b = _mm256_and_si256(vb, mask);
    hi->a = _mm256_and_si256(_mm256_srli_epi16(va, 4), mask), hi->b = _mm256_and_si256(_mm256_srli_epi16(vb, 4), mask);
}
/* The "shifts" plane: byte bit h (lo's) and 4 + h (hi's) to bit 4 by 16-bit shifts (a bit crossing into
 * the next byte lands below bit 4 or above it, h < 4, and the mask drops it), or-ed in. */
#define Q5_MASKS 0
INLINE void wq5(const uint8_t *c, const uint8_t *plane, const int h, vi16 *lo, vi16 *hi)
{
    wq4(c, lo, hi);
    const __m256i pa = _mm256_loadu_si256((const __m256i *)plane), pb = _mm256_loadu_si256((const __m256i *)(plane + 32));
    const __m256i b4 = _mm256_set1_epi8(0x10);
    lo->a = _mm256_or_si256(lo->a, _mm256_and_si256(_mm256_slli_epi16(pa, 4 - h), b4));
    lo->b = _mm256_or_si256(lo->b, _mm256_and_si256(_mm256_slli_epi16(pb, 4 - h), b4));
    hi->a = _mm256_or_si256(hi->a, _mm256_and_si256(_mm256_srli_epi16(pa, h), b4));
    hi->b = _mm256_or_si256(hi->b, _mm256_and_si256(_mm256_srli_epi16(pb, h), b4));
}
/* wq5 of a q6 panel-block's chunk h with bit 5 from the second plane (64 bytes after the first, the same
 * layout): byte bit h (lo's) and 4 + h (hi's) to bit 5 (no other bit lands there, as in wq5). */
INLINE void wq6(const uint8_t *c, const uint8_t *plane, const int h, vi16 *lo, vi16 *hi)
{
    wq5(c, plane, h, lo, hi);
    const __m256i ra = _mm256_loadu_si256((const __m256i *)(plane + 64)), rb = _mm256_loadu_si256((const __m256i *)(plane + 96));
    const __m256i b5 = _mm256_set1_epi8(0x20);
    lo->a = _mm256_or_si256(lo->a, _mm256_and_si256(_mm256_slli_epi16(ra, 5 - h), b5));
    lo->b = _mm256_or_si256(lo->b, _mm256_and_si256(_mm256_slli_epi16(rb, 5 - h), b5));
    const __m256i ha = h ? _mm256_srli_epi16(ra, h - 1) : _mm256_slli_epi16(ra, 1);
    const __m256i hb = h ? _mm256_srli_epi16(rb, h - 1) : _mm256_slli_epi16(rb, 1);
    hi->a = _mm256_or_si256(hi->a, _mm256_and_si256(ha, b5));
    hi->b = _mm256_or_si256(hi->b, _mm256_and_si256(hb, b5));
}
#if defined(__AVXVNNI__)
#define Q8_BIAS 1
typedef vi16 w8_t;
INLINE vi16 dp4(vi16 acc, vi16 u, int32_t x)
{
    const __m256i xv = _mm256_set1_epi32(x);
    acc.a = _mm256_dpbusd_avx_epi32(acc.a, u.a, xv), acc.b = _mm256_dpbusd_avx_epi32(acc.b, u.b, xv);
    return acc;
}
INLINE w8_t w8(const uint8_t *c)
{
    w8_t v = {_mm256_loadu_si256((const __m256i *)c), _mm256_loadu_si256((const __m256i *)(c + 32))};
    return v;
}
INLINE vi16 dp8(vi16 acc, w8_t u, int32_t x) { return dp4(acc, u, x); }
#else
#define Q8_BIAS 0
typedef struct { __m256i a, b, sa, sb; } w8_t; /* |w| and w, lanes 0..7 and 8..15 */
typedef vi16 a4_t; /* int16 lanes: 2 per output */
INLINE a4_t a4_zero(void) { return vi_zero(); }
INLINE a4_t a4_dp(a4_t acc, vi16 u, int32_t x)
{
    const __m256i xv = _mm256_set1_epi32(x);
    acc.a = _mm256_add_epi16(acc.a, _mm256_maddubs_epi16(u.a, xv));
    acc.b = _mm256_add_epi16(acc.b, _mm256_maddubs_epi16(u.b, xv));
    return acc;
}
INLINE vi16 a4_sum(a4_t acc)
{
    const __m256i one = _mm256_set1_epi16(1);
    vi16 v = {_mm256_madd_epi16(acc.a, one), _mm256_madd_epi16(acc.b, one)};
    return v;
}
INLINE w8_t w8(const uint8_t *c)
{
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    const __m256i wa = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)c), bias),
                  wb = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(c + 32)), bias);
    w8_t r = {_mm256_abs_epi8(wa), _mm256_abs_epi8(wb), wa, wb};
    return r;
}
INLINE vi16 dp8(vi16 acc, w8_t w, int32_t x)
{
    const __m256i xv = _mm256_set1_epi32(x), one = _mm256_set1_epi16(1);
    acc.a = _mm256_add_epi32(acc.a, _mm256_madd_epi16(_mm256_maddubs_epi16(w.a, _mm256_sign_epi8(xv, w.sa)), one));
    acc.b = _mm256_add_epi32(acc.b, _mm256_madd_epi16(_mm256_maddubs_epi16(w.b, _mm256_sign_epi8(xv, w.sb)), one));
    return acc;
}
#endif

#else /* scalar: plain loops (itile_any below), no integer lanes */

#define Q8_BIAS 0
#define Q5_MASKS 1 /* the q5 plane's layout (as the exact arithmetic's q4 layout "bytes") */

#endif
#if !Q8_BIAS
#define A4_I16 1 /* vpmaddubsw's int16 lanes (the scalar build has no a4_t) */
#endif

#if Q8_BIAS /* VNNI (either width): a q4 block's products go straight into the int32 lanes */
#define A4_I16 0
typedef vi16 a4_t;
INLINE a4_t a4_zero(void) { return vi_zero(); }
INLINE a4_t a4_dp(a4_t acc, vi16 u, int32_t x) { return dp4(acc, u, x); }
INLINE vi16 a4_sum(a4_t acc) { return acc; }
#endif

/* ---- activations: per row and block of 32, block-major (the layout comment at the top) -------- */

/* One block of 32: q[32], its scale, its code sum. */
INLINE void quant_block(const float *x, int8_t *q, float *s, int32_t *c)
{
#if defined(__AVX512F__)
    const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], mx;
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
#endif
    const float inv = 127.0f / amax; /* max is exact: any order gives this amax */
    if (!(amax > 0.0f) || !(inv < INFINITY)) {
        memset(q, 0, 32);
        *s = 0.0f, *c = 0;
        return;
    }
    *s = amax / 127.0f;
#if defined(__AVX512F__)
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i top = _mm512_set1_epi32(127), bot = _mm512_set1_epi32(-127);
    const __m512i a = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(lo, vi)), top), bot),
                  b = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(hi, vi)), top), bot);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(a));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(b));
    *c = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
#elif defined(__AVX2__)
    const __m256 vi = _mm256_set1_ps(inv);
    const __m256i top = _mm256_set1_epi32(127), bot = _mm256_set1_epi32(-127);
    __m256i r[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi)), top), bot);
        sum = _mm256_add_epi32(sum, r[i]);
    }
    /* int32 -> int8 (in range): packs keep the values, the permute restores the order */
    const __m256i w01 = _mm256_packs_epi32(r[0], r[1]), w23 = _mm256_packs_epi32(r[2], r[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *c = _mm_cvtsi128_si32(s4);
#else
    int32_t sum = 0;
    for (int j = 0; j < 32; j++) {
        float r = nearbyintf(x[j] * inv); /* round to nearest even, as cvtps2dq */
        r = r < 127.0f ? r : 127.0f;
        r = r > -127.0f ? r : -127.0f;
        q[j] = (int8_t)r;
        sum += q[j];
    }
    *c = sum;
#endif
}

#endif
