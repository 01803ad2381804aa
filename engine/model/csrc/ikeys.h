/* Keys of the int8 arithmetic and their attention scores in integers (trserve, engine/model/csrc/):
 * forward.c writes each rotated key quantized, and scores a query against it with exact integer dot
 * products per block of 32 and a fixed float part, the same bits alone, in a panel of 16 keys, or in a
 * batch of any width, and in every build (the contract of qlinear_i8.c, at its top).
 *
 * A key slot is the 2 D bytes of the key's float16 row in the KV buffer (BatchKV; the values stay
 * float16, so the buffer keeps one dtype and every column copy, prefix block and row move carries the
 * slot as it is):
 *   bytes [0, D): the key's codes + 128 (biased: vpdpbusd's unsigned operand), per block of 32
 *                 quantized as the activations are (quant_block: amax / 127, round to nearest even);
 *   bytes [D, D + 4 D / 32): the blocks' float32 scales s_k;
 *   then, where the KV head keeps a RoPE pair kp (dims kp and kp + D / 2, chosen once per model:
 *   engine/model/kernels/outliers.py), their two float32 values; those dims are quantized as zeros.
 * A query is quantized the same way (codes, scale s_q, code sum c per block; the kept dims as zeros,
 * their values aside). Its score on a key:
 *   acc = 0;  for each block b in order:  acc = fma((float)isum_b * s_q[b], s_k[b], acc);
 *   with a kept pair:  acc = fma(q[kp], k[kp], acc);  acc = fma(q[kp + D/2], k[kp + D/2], acc)
 *   score = acc * scale
 * isum_b = the exact integer dot product of the codes (|isum| <= 32 * 127 * 127 < 2^24, exact as a float).
 * A large pair (the keys' outlier dims peak in one rotary pair; a rotation keeps a pair's norm) would
 * coarsen its blocks' scales for every other dim.
 */
#ifndef TRSERVE_IKEYS_H
#define TRSERVE_IKEYS_H

#include "ilanes.h"

#define IKEYS 16 /* keys per panel: a panel's 16 int32 lanes */
#define MAX_IB 8 /* blocks of 32 per key (head_dim <= 256) */

/* x [D] with the kept pair kp (if kp >= 0) as zeros -> buf; its values -> kept[2]. */
INLINE const float *set_aside(const float *x, int64_t D, int32_t kp, float *buf, float *kept)
{
    if (kp < 0) return x;
    memcpy(buf, x, D * sizeof(float));
    kept[0] = x[kp], kept[1] = x[kp + D / 2];
    buf[kp] = buf[kp + D / 2] = 0.0f;
    return buf;
}

/* Key k [D] (rotated) -> its slot. */
INLINE void ikey_write(const float *k, int64_t D, int32_t kp, uint8_t *slot)
{
    float buf[32 * MAX_IB], kept[2];
    const float *x = set_aside(k, D, kp, buf, kept);
    for (int64_t b = 0; b < D / 32; b++) {
        int8_t q[32];
        float s;
        int32_t c;
        quant_block(x + 32 * b, q, &s, &c);
        for (int i = 0; i < 32; i++) slot[32 * b + i] = (uint8_t)(q[i] + 128);
        memcpy(slot + D + 4 * b, &s, sizeof s);
    }
    if (kp >= 0) memcpy(slot + D + 4 * (D / 32), kept, sizeof kept);
}

/* A query quantized: codes, per block its scale and -128 x its code sum (dp8's bias taken back out),
 * and the kept pair's values (kp < 0: none). */
typedef struct {
    int8_t q[32 * MAX_IB];
    float s[MAX_IB];
    int32_t c[MAX_IB];
    float kept[2];
    int32_t kp;
} iquery_t;

INLINE void iquery(const float *x, int64_t D, int32_t kp, iquery_t *q)
{
    float buf[32 * MAX_IB];
    const float *y = set_aside(x, D, kp, buf, q->kept);
    q->kp = kp;
    for (int64_t b = 0; b < D / 32; b++) {
        int32_t c;
        quant_block(y + 32 * b, q->q + 32 * b, q->s + b, &c);
        q->c[b] = -128 * c;
    }
}

/* One key's score (the formula at the top), in plain C: the scalar build's, and the vector builds' for
 * keys outside a panel. */
INLINE float ikey_score(const iquery_t *q, const uint8_t *slot, int64_t D, float scale)
{
    float acc = 0.0f;
    for (int64_t b = 0; b < D / 32; b++) {
        /* the codes as signed bytes first, then a signed dot product: GCC 12 at -O2 with VNNI vectorises a
         * loop of ((int)u8 - 128) * s8 into wrong sums (tests/engine/model/test_native.py caught it) */
        int8_t k[32];
        int32_t isum = 0;
        for (int i = 0; i < 32; i++) k[i] = (int8_t)(slot[32 * b + i] ^ 0x80);
        for (int i = 0; i < 32; i++) isum += k[i] * q->q[32 * b + i];
        float sk;
        memcpy(&sk, slot + D + 4 * b, sizeof sk);
        acc = fmaf((float)isum * q->s[b], sk, acc);
    }
    if (q->kp >= 0) {
        float kept[2];
        memcpy(kept, slot + D + 4 * (D / 32), sizeof kept);
        acc = fmaf(q->kept[0], kept[0], acc);
        acc = fmaf(q->kept[1], kept[1], acc);
    }
    return acc * scale;
}

#if defined(__AVX512F__) || defined(__AVX2__)
#define IKEY_PANELS 1

#if defined(__AVX512F__)
/* rows r[0..15] (16 int32s each) -> out[d] = (r[0][d], .., r[15][d]): a 16 x 16 transpose of int32s */
INLINE void transpose16(const uint8_t *const *row, int64_t off, uint8_t *out)
{
    __m512i r[16], t[16];
    for (int l = 0; l < 16; l++) r[l] = _mm512_loadu_si512(row[l] + off);
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) {
        r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    /* r[4k + i] holds, per 128-bit lane c, element 4c + i of rows 4k .. 4k + 3 */
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 4; i++) {
            t[8 * k + i] = _mm512_shuffle_i32x4(r[8 * k + i], r[8 * k + 4 + i], 0x88);
            t[8 * k + 4 + i] = _mm512_shuffle_i32x4(r[8 * k + i], r[8 * k + 4 + i], 0xDD);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xDD);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_si512(out + 64 * i, r[i]); /* r[i]: element i of every row */
}
#endif

/* 16 keys' slots (row[l]: key l's) as a q8 panel-block per block of 32 (qlinear_i8.c's layout: for
 * block b, group g of 4 inputs, 64 bytes whose lane l holds key l's codes 32 b + 4 g .. + 3) and
 * ks[16 b + l] = key l's scale of block b; with a kept pair (kp >= 0) then its two values,
 * ks[16 (nb + i) + l] for i = 0, 1. */
INLINE void ikey_panel(const uint8_t *const *row, int64_t D, int32_t kp, uint8_t *panel, float *ks)
{
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 64 <= D; c += 64) transpose16(row, c, panel + 16 * c);
#endif
    for (; c < D; c += 4)
        for (int l = 0; l < IKEYS; l++) memcpy(panel + 16 * c + 4 * l, row[l] + c, 4);
    for (int64_t b = 0; b < D / 32 + (kp >= 0 ? 2 : 0); b++) /* the scales, then the kept values */
        for (int l = 0; l < IKEYS; l++) memcpy(ks + IKEYS * b + l, row[l] + D + 4 * b, sizeof(float));
}

/* sc[q][l] = the score of panel key l for query q < NQ (NB blocks of 32; NQ <= 4; KP: the keys keep a
 * pair): per block the integer products (dp8, the key group prepared once for all queries), then the
 * float part in block order and the kept pair, the 16 keys side by side in a v16. */
INLINE void ikey_scores(const int NQ, const int NB, const int KP, const iquery_t *const *qs, const uint8_t *panel,
                        const float *ks, float scale, float *const *sc)
{
    v16 acc[4];
#pragma GCC unroll 4
    for (int q = 0; q < NQ; q++) acc[q] = v_zero();
#pragma GCC unroll 8
    for (int b = 0; b < NB; b++) {
        vi16 ia[4];
#pragma GCC unroll 4
        for (int q = 0; q < NQ; q++) ia[q] = Q8_BIAS ? vi_set1(qs[q]->c[b]) : vi_zero();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const w8_t wg = w8(panel + 64 * (8 * b + g));
#pragma GCC unroll 4
            for (int q = 0; q < NQ; q++) ia[q] = dp8(ia[q], wg, x4(qs[q]->q + 32 * b + 4 * g));
        }
        const v16 vk = v_load(ks + IKEYS * b);
#pragma GCC unroll 4
        for (int q = 0; q < NQ; q++) acc[q] = v_fmav(v_mul(vi_float(ia[q]), qs[q]->s + b), vk, acc[q]);
    }
    if (KP) { /* fma(k, q, acc): the same product as fmaf(q, k, acc) */
#pragma GCC unroll 4
        for (int q = 0; q < NQ; q++) {
            acc[q] = v_fma(v_load(ks + IKEYS * NB), qs[q]->kept, acc[q]);
            acc[q] = v_fma(v_load(ks + IKEYS * (NB + 1)), qs[q]->kept + 1, acc[q]);
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < NQ; q++) v_store(sc[q], v_mul(acc[q], &scale));
}
#else
#define IKEY_PANELS 0 /* scalar: key by key (ikey_score) */
#endif

#endif
