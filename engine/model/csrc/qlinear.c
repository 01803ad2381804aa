/* Exact dequantise-on-the-fly linear layers for CPUs with AVX-512 (trserve, engine/qlinear.py).
 *
 * y[n, O] = x[n, I] @ W^T (+ bias) where W is stored compressed and rebuilt exactly in registers:
 *   q4: W[o, 32b + j] = q * d[o, b] + m[o, b], q in 0..15   (codes[o, 16b + j] = q_j | q_{j+16} << 4)
 *   q8: W[o, 32b + j] = q * d[o, b],           q in -128..127 (codes[o, 32b + j] = q_j)
 * q * d is exact in float32 for these ranges (fp16 scales), so the rebuilt weight equals the stored
 * float32 weight bit for bit (engine/qlinear.py checks this at load).
 *
 * Every output element is computed by the same instruction sequence whatever n is and wherever the
 * row sits in its tile: tree verification (n nodes) and plain decoding (n = 1) get identical
 * numbers for identical inputs. Rows are tiled by 8 so a tile's accumulators stay in registers.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define TILE 8

/* The exact weights of block b of one output row, as two vectors of 16 (kind a constant after inlining). */
static inline __attribute__((always_inline)) void block_weights(
    const int kind, const uint8_t *c, const float *d, const float *m, int64_t b, __m512 *lo, __m512 *hi)
{
    const __m512 vd = _mm512_set1_ps(d[b]);
    if (kind == 4) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * b)));
        const __m512 vm = _mm512_set1_ps(m[b]);
        *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xF))), vd, vm);
        *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), vd, vm);
    } else {
        const __m128i *s = (const __m128i *)(c + 32 * b);
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(s))), vd);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(s + 1))), vd);
    }
}

/* One tile: R rows (R a constant after inlining) x 2 outputs (o, o + 1), so every x load feeds two
 * FMAs. For each (row, output) the sequence is: acc = 0; per block b: acc = fma(w_lo, x_lo, acc),
 * acc = fma(w_hi, x_hi, acc); out = reduce_add(acc): the same for every R and every tile position. */
static inline __attribute__((always_inline)) void tile(
    const int kind, const int R, const float *x, int64_t I, const uint8_t *c0, const uint8_t *c1,
    const float *d0, const float *d1, const float *m0, const float *m1, int64_t nb, float *out0, float *out1)
{
    __m512 a0[TILE], a1[TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        __m512 w0lo, w0hi, w1lo, w1hi;
        block_weights(kind, c0, d0, m0, b, &w0lo, &w0hi);
        block_weights(kind, c1, d1, m1, b, &w1lo, &w1hi);
        const float *xb = x + 32 * b;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512 xlo = _mm512_loadu_ps(xb + r * I), xhi = _mm512_loadu_ps(xb + r * I + 16);
            a0[r] = _mm512_fmadd_ps(w0lo, xlo, a0[r]);
            a0[r] = _mm512_fmadd_ps(w0hi, xhi, a0[r]);
            a1[r] = _mm512_fmadd_ps(w1lo, xlo, a1[r]);
            a1[r] = _mm512_fmadd_ps(w1hi, xhi, a1[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) { out0[r] = _mm512_reduce_add_ps(a0[r]); out1[r] = _mm512_reduce_add_ps(a1[r]); }
}

#define DISPATCH(CALL) \
    switch (rows) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
                     case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; \
                     case 7: CALL(7); break; default: CALL(8); break; }

/* x: [n, I] row-major, I % 32 == 0; O even; codes/d/m per output row; bias may be NULL; y: [n, O]. */
void trserve_qlinear(int kind, const float *x, int64_t n, int64_t I, int64_t O, const uint8_t *codes,
                     const float *d, const float *m, const float *bias, float *y, int threads)
{
    const int64_t nb = I / 32;
    const int64_t row_bytes = kind == 4 ? I / 2 : I;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < O / 2; p++) {
        const int64_t o = 2 * p;
        float out0[TILE], out1[TILE];
        const uint8_t *c0 = codes + o * row_bytes, *c1 = c0 + row_bytes;
        const float *d0 = d + o * nb, *d1 = d0 + nb;
        const float *m0 = kind == 4 ? m + o * nb : NULL, *m1 = kind == 4 ? m0 + nb : NULL;
        for (int64_t r0 = 0; r0 < n; r0 += TILE) {
            const int rows = n - r0 < TILE ? (int)(n - r0) : TILE;
            const float *xr = x + r0 * I;
            if (kind == 4) {
#define CALL4(R) tile(4, R, xr, I, c0, c1, d0, d1, m0, m1, nb, out0, out1)
                DISPATCH(CALL4)
#undef CALL4
            } else {
#define CALL8(R) tile(8, R, xr, I, c0, c1, d0, d1, m0, m1, nb, out0, out1)
                DISPATCH(CALL8)
#undef CALL8
            }
            for (int r = 0; r < rows; r++) {
                y[(r0 + r) * O + o] = bias ? out0[r] + bias[o] : out0[r];
                y[(r0 + r) * O + o + 1] = bias ? out1[r] + bias[o + 1] : out1[r];
            }
        }
    }
}
