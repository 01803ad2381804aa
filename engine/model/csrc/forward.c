/* The whole decoder stack of a llama-family model in one call (trserve, engine/model/native.py).
 *
 * A forward over N new tokens of B sequences (a packed batch: sequence b owns tokens
 * tok0[b] .. tok0[b + 1] - 1, with no padding) on the exact compressed linear kernels of
 * qlinear.c, with every other op written out here: RMSNorm, rotary embedding (cos/sin tables from
 * the model's own rotary module), grouped-query attention over each sequence's KV row with its
 * tree mask, SiLU-gated MLP, residuals, final norm, LM head on the kept tokens. One run of the
 * kernels' thread pool (pool.h) spans the whole forward (a barrier between phases), so a step costs
 * one call instead of the ~2,000 small dispatched ops of the eager modules.
 *
 * What the engine relies on: every token's numbers depend only on its own input, position and the
 * keys/values it sees, in a fixed order, never on N, B, or where the token sits in the batch:
 *   - linear layers: qlinear.c's per-row guarantee;
 *   - RMSNorm: sum of squares in the 16-lane order of dot.h (acc_block/acc_reduce);
 *   - attention of a query: its visible keys in ascending KV column order (context columns, then
 *     the step's new columns), dot products in the 16-lane order (several keys' reductions side by
 *     side, each with the same pairing tree), the max (exact in any order), exp, the sum and the
 *     weighted sum of values accumulated key by key in that order; masked keys are skipped, not
 *     added as zeros. A layer's sliding window (tr_layer.window: Mistral's layers, Qwen2/Qwen3's
 *     sliding_attention ones) masks by position as transformers' sliding_window_overlay does: a
 *     query at position p sees a key at position k only where p - k < window (a context column's
 *     position is its column, a new key's its pos[]: window_row), so which keys a query sees still
 *     depends only on its own position and tree, never on the batch;
 *   - exp is a written-out polynomial (exp_poly), the same op sequence in every build.
 * So a tree node's logits equal those of the same token decoded alone on the same context (TR ==
 * plain decoding bit for bit), and the AVX-512, AVX2 and scalar builds give the same bits.
 *
 * Conventions as transformers' Llama modules: q head h uses KV head h / (heads / kv_heads);
 * rotate_half pairs lane i with i + D/2; RMSNorm y = w * (x * (1 / sqrt(mean(x^2) + eps))). Qwen3's
 * per-head q/k norms (tr_layer.q_norm, k_norm) are that RMSNorm over each head's D values, after
 * q_proj / k_proj and before rotary (so before a key is stored, in either arithmetic), as its
 * Qwen3Attention applies them: each token's and head's own numbers, the same in every build.
 * Gemma 2/3 (tr_model.act, embed_scale, attn_softcap, final_softcap; tr_layer.attn_out_norm,
 * mlp_out_norm, rope_table): a GeGLU MLP (gated: GELU's tanh form), embedding rows scaled, the
 * attention's and the MLP's outputs RMS-normed (each row whole, by one thread) before their residual
 * adds, (1 + w) norm weights folded by the caller, Gemma 3's local layers on a second rotary table,
 * Gemma 2's cap * tanh(x / cap) on the scaled attention scores (before the max) and on the logits
 * (softcap). Each is per token or per row in a fixed order, so the guarantees above hold for them.
 */
#include "forward.h"
#include "dot.h"
#include "pool.h"
#include "ikeys.h"
#include "qlinear.h"
#include "vec.h"

/* ---- phase timing (profiling builds only) -----------------------------------------------------
 * Built with -DTR_PHASES (engine/model/kernels/build.py:phases_library, for `trserve bench --profile`):
 * the wall time of each phase of the forward as its thread 0 sees it, summed over calls until
 * trserve_forward_phases reads them. Each phase but the LM head's ends at a barrier, so its time
 * includes waiting for the slower thread. Other builds compile none of it. */
#ifdef TR_PHASES
#include <time.h>
enum { PH_QKV, PH_ROPE, PH_ATTENTION, PH_O, PH_GATE_UP, PH_DOWN, PH_HEAD, PH_TOPK, PH_CALL, N_PHASES };
static double phase_s[N_PHASES];
static int64_t phase_calls;
static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define PHASES_START double t_phase = id == 0 ? now_s() : 0.0
#define PHASE(i) do { if (id == 0) { const double t_ = now_s(); phase_s[i] += t_ - t_phase; t_phase = t_; } } while (0)

/* out[i] = phase i's seconds summed since the last read (i < n, at most N_PHASES: qkv, rope, attention,
 * o, gate_up, down, head, topk, the whole call); resets them; returns the calls they cover. */
int64_t trserve_forward_phases(double *out, int64_t n)
{
    for (int64_t i = 0; i < n && i < N_PHASES; i++) out[i] = phase_s[i];
    memset(phase_s, 0, sizeof phase_s);
    const int64_t calls = phase_calls;
    phase_calls = 0;
    return calls;
}
#else
#define PHASES_START
#define PHASE(i) ((void)0)
#endif

/* Queries of one head an attention pass takes side by side (they share each key and value load);
 * never changes a query's arithmetic. */
#if defined(__AVX512F__)
#define QPASS 4
#elif defined(__AVX2__)
#define QPASS 2
#else
#define QPASS 1
#endif


/* ---- written-out helpers (the same op sequence in every build) -------------------------------- */

/* exp(x) for x in [-87, 88] (clamped there) within ~2 ulp: 2^n * p(r), n = floor(x log2(e) + 1/2),
 * r = x - n ln2 (in two fmas), Cephes coefficients. Written out once per build with the same IEEE
 * operations per element (the clamps as max/min with the bound second, as maxps/minps take it). */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1 -0.693359375f
#define EXP_C2 2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

INLINE float exp1(float v)
{
    v = v > -87.0f ? v : -87.0f;
    v = v < 88.0f ? v : 88.0f;
    const float t = floorf(v * EXP_LOG2E + 0.5f);
    float r = fmaf(t, EXP_C1, v);
    r = fmaf(t, EXP_C2, r);
    float p = EXP_P0;
    p = fmaf(p, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
    const float y = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } s = {.i = ((int32_t)t + 127) << 23};
    return y * s.f;
}

#if defined(__AVX512F__)
INLINE __m512 exp16(__m512 v)
{
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(EXP_LOG2E)), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(t, _mm512_set1_ps(EXP_C1), v);
    r = _mm512_fmadd_ps(t, _mm512_set1_ps(EXP_C2), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(t), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#define EXP_LANES 16
INLINE void exp_lanes(float *x) { _mm512_storeu_ps(x, exp16(_mm512_loadu_ps(x))); }
#elif defined(__AVX2__)
INLINE __m256 exp8(__m256 v)
{
    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(EXP_LOG2E)), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fmadd_ps(t, _mm256_set1_ps(EXP_C1), v);
    r = _mm256_fmadd_ps(t, _mm256_set1_ps(EXP_C2), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(t), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#define EXP_LANES 8
INLINE void exp_lanes(float *x) { _mm256_storeu_ps(x, exp8(_mm256_loadu_ps(x))); }
#else
#define EXP_LANES 1
INLINE void exp_lanes(float *x) { *x = exp1(*x); }
#endif

/* x[i] = exp(x[i]), i < n: whole vectors, then the tail one by one (same bits either way) */
static void exp_poly(float *x, int64_t n)
{
    int64_t i = 0;
    for (; i + EXP_LANES <= n; i += EXP_LANES) exp_lanes(x + i);
    for (; i < n; i++) x[i] = exp1(x[i]);
}

/* cap * tanh(x[i] / cap) for i < n (cap > 0; Gemma 2's soft-capping of attention scores and logits),
 * tanh(a) = sign(a) (1 - e) / (1 + e) with e = exp(-2 |a|) by exp1: the same ops on every build. */
static void softcap(float *x, int64_t n, float cap)
{
    for (int64_t i = 0; i < n; i++) {
        const float a = x[i] / cap, e = exp1(-2.0f * fabsf(a)), t = (1.0f - e) / (1.0f + e);
        x[i] = cap * (a < 0.0f ? -t : t);
    }
}

/* g[i] = act(g[i]) * u[i], i < n, for the gated MLP's activation (tr_model.act): SiLU as torch,
 * g / (1 + exp(-g)); or GELU's tanh form (gelu_pytorch_tanh) 0.5 g (1 + tanh(c)), c = sqrt(2 / pi)
 * (g + 0.044715 g^3) as torch orders it, written g / (1 + exp(-2 c)) (the same function: 1 + tanh(c) =
 * 2 / (1 + exp(-2 c))), exact where tanh(c) nears -1. sc: n floats of scratch. */
static void gated(int64_t act, float *g, const float *u, int64_t n, float *sc)
{
    if (act == 1) {
        const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
        for (int64_t i = 0; i < n; i++) sc[i] = -2.0f * (beta * (g[i] + kappa * (g[i] * g[i] * g[i])));
    } else {
        for (int64_t i = 0; i < n; i++) sc[i] = -g[i];
    }
    exp_poly(sc, n);
    for (int64_t i = 0; i < n; i++) g[i] = (g[i] / (1.0f + sc[i])) * u[i];
}

/* g[i] = act(g[i]) * u[i], i < n, as the forward's MLP computes it (tests: GELU's tanh form against torch's,
 * the same bits on every build). sc: n floats of scratch. 0, or -1 for an act other than 0 (SiLU), 1 (GELU). */
int trserve_gated(int64_t act, float *g, const float *u, int64_t n, float *sc)
{
    if (act != 0 && act != 1) return -1;
    gated(act, g, u, n, sc);
    return 0;
}

/* y[r] = w * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))) for rows [r0, r1) */
static void rms_rows(const float *x, const float *w, float *y, int64_t r0, int64_t r1, int64_t H, float eps)
{
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * H;
        const float inv = 1.0f / sqrtf(dot32(xr, xr, H) / (float)H + eps);
        float *yr = y + r * H;
        for (int64_t i = 0; i < H; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* A head's D values x normed in place as rms_rows norms a row (w: [D] weights), or left as they are
 * where w is NULL: Qwen3's q_norm / k_norm, before rotary. */
INLINE void head_norm(float *x, const float *w, int64_t D, float eps)
{
    if (w) rms_rows(x, w, x, 0, 1, D, eps);
}

/* x [n, I] quantized into this thread's a when the model runs the int8 arithmetic, w's kept inputs
 * aside (w: the first matrix reading x; those after it keep the same inputs). Every thread quantizes
 * all rows itself: no barrier; the same bits in each. */
static void lin_quant(const tr_model *M, const tr_qmat *w, const float *x, int64_t n, int64_t I, qact_t *a)
{
    if (M->arith) {
        a->n = n;
        quant_rows(x, n, I, a, w->kept, w->n_kept);
    }
}

/* This thread's share of y[n, O] = x[n, I] @ W^T (+ bias) in the model's arithmetic (int8: from a,
 * which lin_quant filled from x): outputs [*o0, *o1). */
static void lin(const tr_model *M, const tr_qmat *w, const float *x, const qact_t *a, int64_t n, float *y, int64_t id,
                int64_t nt, int64_t *o0, int64_t *o1)
{
    const qmat_t q = {(int)w->kind, w->in, w->out, w->in / 32, w->codes, w->d, w->m, w->bias, w->n_kept, w->kept_w};
    if (M->arith) imat_rows(&q, a, y, id, nt, o0, o1);
    else qmat_rows(&q, x, n, y, id, nt, o0, o1);
}

/* q[t, i] and q[t, i + R/2] rotated as transformers' apply_rotary_pos_emb (q * cos + rotate_half(q) * sin)
 * for i < R/2, R the rotary dims (the head dim D, or fewer with partial rotary: modeling_phi3.py's q_rot
 * = q[..., :R]); q[R..D) is left as it is (its q_pass) */
INLINE void rope(float *q, const float *c, const float *s, int64_t R)
{
    const int64_t h = R / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = q[i], b = q[i + h];
        q[i] = a * c[i] + (-b) * s[i];
        q[i + h] = b * c[i + h] + a * s[i + h];
    }
}

/* The largest of x[0 .. n - 1] (n >= 1), as a scan keeping the first of equals would find it: 16
 * lanes of running maxima (lane l takes x[16c + l]; the compiler vectorises the lanes), then the
 * lanes in order. max is exact, so for numbers any order gives this value. */
INLINE float max_lanes(const float *x, int64_t n)
{
    float m[16];
    for (int l = 0; l < 16; l++) m[l] = x[l < n ? l : 0];
    int64_t i = n < 16 ? n : 16;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) m[l] = x[i + l] > m[l] ? x[i + l] : m[l];
    for (; i < n; i++) m[i & 15] = x[i] > m[i & 15] ? x[i] : m[i & 15];
    float r = m[0];
    for (int l = 1; l < 16; l++) r = m[l] > r ? m[l] : r;
    return r;
}

/* sc[L] = scale * dot(q, K[key L]) for the REDUCE_KEYS keys L = 0 .. REDUCE_KEYS - 1 of D floats each
 * (row stride D; key L is row L, or row idx[L] given an index list), each dot product in dot.h's
 * 16-lane order (dot32) and the keys reduced side by side (reduce_keys_store gives acc_reduce's bits). */
INLINE void key_scores(const int NB, const float *qv, const float *K, const int32_t *idx, int64_t D, float scale,
                       float *sc)
{
    acc_t a[REDUCE_KEYS];
#pragma GCC unroll 16
    for (int s = 0; s < REDUCE_KEYS; s++) {
        const int64_t j = idx ? idx[REDUCE_KEY(s)] : REDUCE_KEY(s); /* so that key L ends in lane L */
        a[s] = acc_zero();
#pragma GCC unroll 8
        for (int i = 0; i < NB; i++) {
            const wblock_t w = float_block(qv + 32 * i);
            acc_block(&a[s], &w, K + j * D + 32 * i);
        }
    }
    reduce_keys_store(a, scale, sc);
}

/* Values of the int8 arithmetic are float16 (H16; the KV buffers' dtype, BatchKV): written with
 * v_to_half (rounded to nearest even, clamped to +-65504), widened exactly where they are used, so a
 * pass reads half the bytes (its keys: ikeys.h). kv_vec: 16 elements of row j from element i. */
INLINE v16 kv_vec(const int H16, const void *X, int64_t j, int64_t D, int64_t i)
{
    return H16 ? v_half((const uint16_t *)X + j * D + i) : v_load((const float *)X + j * D + i);
}

/* x [n] (n % 16 == 0) -> h [n] as v_to_half writes keys and values (tests: every build the same bits,
 * and numpy's rounding). 0, or -1 for n not a multiple of 16. */
int trserve_to_half(const float *x, int64_t n, uint16_t *h)
{
    if (n % 16) return -1;
    for (int64_t i = 0; i < n; i += 16) v_to_half(x + i, h + i);
    return 0;
}

/* Scores of NQ queries of one head over one sequence's visible keys in ascending column order: context
 * columns [c0, L) (c0: the first any of the queries sees, 0 but under a sliding window) at sc[j], then
 * the step's new columns where the query's mask row says so from sc[L] on, into scs[q] [m[q] in all].
 * fscores: float32 keys (the exact arithmetic), each dot product in dot.h's order; a block of keys
 * stays in L1 for all the queries. A key's score is the same number whichever block it falls in, so
 * c0 changes which keys are scored, never a score. */
INLINE void fscores(const int NQ, const int nb, int64_t D, float scale, const float *const *qs,
                    const uint8_t *const *masks, const float *K, const float *Kn, int64_t c0, int64_t L, int64_t w,
                    float *const *scs, int64_t *m)
{
    int64_t j0 = c0;
    for (; j0 + REDUCE_KEYS <= L; j0 += REDUCE_KEYS)
#pragma GCC unroll 4
        for (int q = 0; q < NQ; q++) key_scores(nb, qs[q], K + j0 * D, NULL, D, scale, scs[q] + j0);
    for (int q = 0; q < NQ; q++) {
        float *sc = scs[q];
        for (int64_t j = j0; j < L; j++) sc[j] = dot32(qs[q], K + j * D, D) * scale;
        m[q] = L;
        /* the step's visible new keys in column order, REDUCE_KEYS at a time as they are found (a
         * prefill chunk's causal rows), the last few one by one: the same numbers */
        int32_t seen[REDUCE_KEYS];
        int n_seen = 0;
        for (int64_t j = 0; j < w; j++) {
            if (!masks[q][j]) continue;
            seen[n_seen++] = (int32_t)j;
            if (n_seen == REDUCE_KEYS) {
                key_scores(nb, qs[q], Kn, seen, D, scale, sc + m[q]);
                m[q] += REDUCE_KEYS, n_seen = 0;
            }
        }
        for (int i = 0; i < n_seen; i++) sc[m[q]++] = dot32(qs[q], Kn + seen[i] * D, D) * scale;
    }
}

/* iscores: the int8 arithmetic's keys (ikeys.h: slots of 2 D bytes), the queries quantized once per
 * pass. IKEYS keys at a time as a panel built once for all the pass's queries: the context's, then the
 * step's new columns, visible or not (their scores land at column L + j and each query keeps its
 * visible ones, in order, in place); the rest one by one. Every key's score is the same number either
 * way. */
INLINE void iscores(const int NQ, const int nb, int64_t D, int32_t kp, float scale, const float *const *qs,
                    const uint8_t *const *masks, const uint8_t *K, const uint8_t *Kn, int64_t c0, int64_t L,
                    int64_t w, float *const *scs, int64_t *m)
{
    const int64_t S = 2 * D; /* a slot's bytes */
    iquery_t iq[QPASS];
    const iquery_t *iqs[QPASS];
    for (int q = 0; q < NQ; q++) iquery(qs[q], D, kp, iq + q), iqs[q] = iq + q;
    int64_t j0 = c0, j1 = 0; /* context keys [c0, j0) and new ones [0, j1) scored by panels */
#if IKEY_PANELS
    uint8_t panel[IKEYS * 32 * MAX_IB];
    float ks[IKEYS * (MAX_IB + 2)];
    const uint8_t *row[IKEYS];
    float *o[QPASS];
    for (; j0 + IKEYS <= L; j0 += IKEYS) {
        for (int l = 0; l < IKEYS; l++) row[l] = K + (j0 + l) * S;
        ikey_panel(row, D, kp, panel, ks);
        for (int q = 0; q < NQ; q++) o[q] = scs[q] + j0;
        ikey_scores(NQ, nb, kp >= 0, iqs, panel, ks, scale, o);
    }
    int64_t wv = 0; /* new columns up to the last any of the pass's queries sees (a prefill chunk's
                     * early queries see few of them) */
    for (int q = 0; q < NQ; q++)
        for (int64_t j = w - 1; j >= wv; j--)
            if (masks[q][j]) {
                wv = j + 1;
                break;
            }
    for (; j1 + IKEYS <= wv; j1 += IKEYS) { /* a prefill chunk's keys (a tree step's are fewer) */
        for (int l = 0; l < IKEYS; l++) row[l] = Kn + (j1 + l) * S;
        ikey_panel(row, D, kp, panel, ks);
        for (int q = 0; q < NQ; q++) o[q] = scs[q] + L + j1;
        ikey_scores(NQ, nb, kp >= 0, iqs, panel, ks, scale, o);
    }
#else
    (void)nb, (void)iqs;
#endif
    for (int q = 0; q < NQ; q++) {
        float *sc = scs[q];
        for (int64_t j = j0; j < L; j++) sc[j] = ikey_score(iq + q, K + j * S, D, scale);
        m[q] = L;
        for (int64_t j = 0; j < w; j++) /* m[q] <= L + j: in place */
            if (masks[q][j]) sc[m[q]++] = j < j1 ? sc[L + j] : ikey_score(iq + q, Kn + j * S, D, scale);
    }
}

/* Attention of NQ queries of one head over one sequence's keys, side by side (each query's numbers
 * exactly as if alone): scores of the visible keys (fscores, or iscores where I8 says the keys are the
 * int8 arithmetic's), max, exp, the sum of the exponentials in that order, then the weighted sum of
 * values key by key in that order (float32 values, or H16 float16 ones widened exactly); out = acc / l.
 * NV = D / 16 vectors per row: a constant (2, 4, 8) keeps each query's value accumulators in
 * registers; 0 takes D at run time. qs, masks, lo, scs, outs: per query its vector, mask row [w], first
 * visible context column (0, or where a sliding window starts: columns [lo, L) are its context keys),
 * score buffer [L + w], output [D]. A query's keys, their order and every op on them are the same
 * whatever the other queries of the pass see (the columns below one's lo are skipped, not added as
 * zeros). */
#define MAX_NV 16
INLINE void attend_pass(const int NQ, const int NV, const int I8, int64_t D, int32_t kp, float scale, float cap,
                        const float *const *qs,
                        const uint8_t *const *masks, const int64_t *lo, const void *K, const void *V, const void *Kn,
                        const void *Vn, int64_t L, int64_t w, float *const *scs, float *const *outs)
{
    const int H16 = I8; /* the int8 arithmetic's values are float16 */
    const int nv = NV ? NV : (int)(D / 16), nb = nv / 2; /* nb: a constant wherever NV is */
    int64_t m[QPASS], c0 = lo[0], c1 = lo[0]; /* the smallest and largest lo: [c1, L) every query sees */
    for (int q = 1; q < NQ; q++) {
        c0 = lo[q] < c0 ? lo[q] : c0;
        c1 = lo[q] > c1 ? lo[q] : c1;
    }
    if (I8)
        iscores(NQ, nb, D, kp, scale, qs, masks, (const uint8_t *)K, (const uint8_t *)Kn, c0, L, w, scs, m);
    else
        fscores(NQ, nb, D, scale, qs, masks, (const float *)K, (const float *)Kn, c0, L, w, scs, m);
    for (int q = 0; q < NQ; q++) { /* the query's visible scores: sc[lo[q] .. m[q]) */
        float *sc = scs[q] + lo[q];
        const int64_t n = m[q] - lo[q];
        if (cap > 0.0f) softcap(sc, n, cap); /* Gemma 2: on the scaled scores, before the softmax */
        const float mx = max_lanes(sc, n);
        for (int64_t j = 0; j < n; j++) sc[j] -= mx;
        exp_poly(sc, n);
    }
    /* each query's sum of its exponentials l in key order (context keys, then its visible new keys),
     * taken in the loops of the weighted sums below: its chain of adds waits on each add's latency,
     * and beside the value accumulators' chains that wait costs nothing */
    float l[QPASS];
    v16 acc[QPASS][MAX_NV];
    for (int q = 0; q < NQ; q++) {
        l[q] = 0.0f;
        for (int v = 0; v < nv; v++) acc[q][v] = v_zero();
    }
    for (int64_t j = c0; j < c1; j++) { /* context columns some queries of the pass are past (windows) */
        for (int q = 0; q < NQ; q++)
            if (j >= lo[q]) {
                l[q] += scs[q][j];
                for (int v = 0; v < nv; v++) acc[q][v] = v_fma(kv_vec(H16, V, j, D, 16 * v), scs[q] + j, acc[q][v]);
            }
    }
    for (int64_t j = c1; j < L; j++) {
#pragma GCC unroll 4
        for (int q = 0; q < NQ; q++) l[q] += scs[q][j];
        for (int v = 0; v < nv; v++) {
            const v16 x = kv_vec(H16, V, j, D, 16 * v);
#pragma GCC unroll 4
            for (int q = 0; q < NQ; q++) acc[q][v] = v_fma(x, scs[q] + j, acc[q][v]); /* fma(p, v[d], acc[d]) */
        }
    }
    /* the step's new keys, each query's visible ones in column order as above, the queries side by
     * side (their accumulators stay in registers; a prefill chunk's query sees up to a chunk of them) */
    const float *p[QPASS];
    for (int q = 0; q < NQ; q++) p[q] = scs[q] + L;
    for (int64_t j = 0; j < w; j++) {
#pragma GCC unroll 4
        for (int q = 0; q < NQ; q++)
            if (masks[q][j]) {
                l[q] += *p[q];
                for (int v = 0; v < nv; v++) acc[q][v] = v_fma(kv_vec(H16, Vn, j, D, 16 * v), p[q], acc[q][v]);
                p[q]++;
            }
    }
    for (int q = 0; q < NQ; q++)
        for (int v = 0; v < nv; v++) v_store(outs[q] + 16 * v, v_div(acc[q][v], l[q]));
}

/* Query t's visible keys under a sliding window of W > 0 (tr_layer.window), by position as transformers'
 * sliding_window_overlay keeps them (key position k > p - W, p = pos[t]): its first context column lo
 * (context column c holds position c: a KV row keeps its context in position order, BatchKV), and its
 * mask row over the w new keys (positions kpos[j]) with those the window drops cleared, into wm [w]. */
INLINE int64_t window_row(int64_t W, int64_t p, int64_t L, const int64_t *kpos, const uint8_t *row, int64_t w,
                          uint8_t *wm)
{
    const int64_t lo = p - W + 1;
    for (int64_t j = 0; j < w; j++) wm[j] = row[j] && p - kpos[j] < W;
    return lo < 0 ? 0 : (lo < L ? lo : L);
}

/* Attention of sequence b's queries i0 .. i1 - 1 in head hd: out[t, hd*D ..] for those tokens t, QPASS
 * queries per pass; W: the layer's sliding window (0: none). sc: this thread's score buffers, QPASS x
 * (ctx[b] + w + 1) floats at most; wm: its mask rows under a window, QPASS x w bytes. */
static void attend(const tr_model *M, int64_t b, int64_t hd, int64_t i0, int64_t i1, const int64_t *tok0, const int64_t *ctx,
                   const int64_t *start, const int64_t *kv_row, const int64_t *pos, int64_t W, const uint8_t *vis,
                   const int64_t *vis0, const float *q, const float *kc, const float *vc, const int32_t *key_pair,
                   int64_t cap, float *out, float *sc, int64_t sc_len, uint8_t *wm)
{
    const int64_t D = M->head_dim, Hq = M->heads, Hkv = M->kv_heads, g = hd / (Hq / Hkv);
    const int32_t kp = key_pair ? key_pair[g] : -1; /* int8: the KV head's kept pair (ikeys.h) */
    const int64_t w = tok0[b + 1] - tok0[b], L = ctx[b];
    const int64_t at = ((kv_row[b] * Hkv + g) * cap) * D, at_new = at + start[b] * D; /* elements */
    const int h16 = M->arith != 0; /* the int8 arithmetic's KV buffers hold float16 (key slots, values) */
    const void *K = h16 ? (const void *)((const uint16_t *)kc + at) : (const void *)(kc + at);
    const void *V = h16 ? (const void *)((const uint16_t *)vc + at) : (const void *)(vc + at);
    const void *Kn = h16 ? (const void *)((const uint16_t *)kc + at_new) : (const void *)(kc + at_new);
    const void *Vn = h16 ? (const void *)((const uint16_t *)vc + at_new) : (const void *)(vc + at_new);
    for (int64_t i = i0; i < i1; i += QPASS) {
        const int nq = i1 - i < QPASS ? (int)(i1 - i) : QPASS;
        const float *qs[QPASS];
        const uint8_t *masks[QPASS];
        float *scs[QPASS], *outs[QPASS];
        int64_t lo[QPASS];
        for (int k = 0; k < nq; k++) {
            const int64_t t = tok0[b] + i + k;
            qs[k] = q + (t * Hq + hd) * D;
            masks[k] = vis + vis0[b] + (i + k) * w;
            lo[k] = 0;
            if (W > 0 && pos[t] >= W) { /* below W every key (positions >= 0) is inside the window */
                lo[k] = window_row(W, pos[t], L, pos + tok0[b], masks[k], w, wm + k * w);
                masks[k] = wm + k * w;
            }
            scs[k] = sc + k * sc_len;
            outs[k] = out + (t * Hq + hd) * D;
        }
#define PASS(NQ, NV) (h16 ? attend_pass(NQ, NV, 1, D, kp, M->scale, M->attn_softcap, qs, masks, lo, K, V, Kn, Vn, L, w, \
                                      scs, outs) \
                          : attend_pass(NQ, NV, 0, D, -1, M->scale, M->attn_softcap, qs, masks, lo, K, V, Kn, Vn, L, w, \
                                        scs, outs))
#define PASSES(NV) switch (nq) { case 1: PASS(1, NV); break; case 2: if (QPASS >= 2) PASS(2, NV); break; \
                                 case 3: if (QPASS >= 3) PASS(3, NV); break; default: PASS(QPASS, NV); break; }
        if (D == 64) { PASSES(4) }
        else if (D == 128) { PASSES(8) }
        else if (D == 32) { PASSES(2) }
        else { PASSES(0) }
#undef PASSES
#undef PASS
    }
}

/* Bit i set where x[i] > t, for the 16 values x[0 .. 15] (NaNs never set: ordered compares). */
INLINE uint32_t above16(const float *x, float t)
{
#if defined(__AVX512F__)
    return (uint32_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(t), _CMP_GT_OQ);
#elif defined(__AVX2__)
    const __m256 tv = _mm256_set1_ps(t);
    const uint32_t lo = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), tv, _CMP_GT_OQ));
    const uint32_t hi = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + 8), tv, _CMP_GT_OQ));
    return lo | hi << 8;
#else
    uint32_t m = 0;
    for (int l = 0; l < 16; l++) m |= (uint32_t)(x[l] > t) << l;
    return m;
#endif
}

/* x[i] into the running top list val/idx [n of K] (largest first, an equal later value loses). */
INLINE void topk_take(float v, int64_t i, int64_t K, int64_t *n, float *val, int32_t *idx)
{
    int64_t p;
    if (v != v) return;
    if (*n == K) {
        if (!(v > val[K - 1])) return; /* not above the K-th: an equal later one loses */
        p = K - 1;                     /* the K-th drops out */
    } else {
        p = (*n)++;
    }
    for (; p > 0 && val[p - 1] < v; p--) val[p] = val[p - 1], idx[p] = idx[p - 1];
    val[p] = v, idx[p] = (int32_t)i;
}

/* The K largest of x[0 .. V - 1] -> idx[0 .. K - 1], largest first, equal values by lower index
 * (so idx[0] is the first maximum, as torch.argmax picks; NaNs are never taken). K <= V. Once the
 * list is full, 16 values at a time are compared with the K-th: a block with none above it is
 * skipped whole (none of them would be taken: the K-th only rises), the others go one by one in
 * index order. The same picks as taking every value in turn, on every build. */
static void topk_row(const float *x, int64_t V, int64_t K, int32_t *idx)
{
    float val[64]; /* K <= 64 (the engine's k) */
    int64_t n = 0, i = 0;
    for (; i < V && (n < K || (i & 15)); i++) topk_take(x[i], i, K, &n, val, idx);
    for (; i + 16 <= V; i += 16)
        for (uint32_t m = above16(x + i, val[K - 1]); m; m &= m - 1) {
            const int l = __builtin_ctz(m);
            topk_take(x[i + l], i + l, K, &n, val, idx);
        }
    for (; i < V; i++) topk_take(x[i], i, K, &n, val, idx);
    for (; n < K; n++) idx[n] = -1; /* fewer than K values that are not NaN */
}

/* topk_row over m rows of x [m, V] -> idx [m, K] (tests; the forward calls topk_row itself). */
int trserve_topk_rows(const float *x, int64_t m, int64_t V, int64_t K, int32_t *idx)
{
    if (K < 1 || K > 64 || K > V) return -1;
    for (int64_t i = 0; i < m; i++) topk_row(x + i * V, V, K, idx + i * K);
    return 0;
}

/* The softmax probability of chosen ids as uint8 buckets (engine/tr/confidence.py): for a row x
 * [V] and its K ids idx [K] (idx[0] its argmax, as topk_row gives them; ids outside [0, V) get 0):
 * q = round(255 * exp(x[id] - max) / sum_j exp(x[j] - max)). The exp is exp_poly's, over the row in
 * chunks. What each recycled matrix row keeps beside its ids. */
static void top_probs_row(const float *row, int64_t V, int64_t K, const int32_t *ids, uint8_t *q)
{
    float buf[1024];
    float mx = (ids[0] >= 0 && ids[0] < V) ? row[ids[0]] : row[0];
    double sum = 0.0;
    for (int64_t c = 0; c < V; c += 1024) {
        const int64_t n = V - c < 1024 ? V - c : 1024;
        float s[8] = {0}; /* 8 running sums: one chain of adds would wait on each add's latency */
        for (int64_t i = 0; i < n; i++) buf[i] = row[c + i] - mx;
        exp_poly(buf, n);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) s[j] += buf[i + j];
        for (; i < n; i++) s[0] += buf[i];
        sum += (double)((s[0] + s[1]) + (s[2] + s[3])) + (double)((s[4] + s[5]) + (s[6] + s[7]));
    }
    for (int64_t k = 0; k < K; k++) {
        const int32_t id = ids[k];
        float p = (id >= 0 && id < V && sum > 0.0) ? (float)(exp1(row[id] - mx) / sum) : 0.0f;
        p = p > 0.0f ? (p < 1.0f ? p : 1.0f) : 0.0f; /* NaN -> 0 */
        q[k] = (uint8_t)(p * 255.0f + 0.5f);
    }
}

/* top_probs_row over m rows of x [m, V] and their ids idx [m, K] -> q [m, K], one thread (the forward
 * computes them itself, in its pool, when asked). */
int trserve_top_probs(const float *x, int64_t m, int64_t V, int64_t K, const int32_t *idx, uint8_t *q)
{
    if (K < 1 || K > 64 || V < 1) return -1;
    for (int64_t r = 0; r < m; r++) top_probs_row(x + r * V, V, K, idx + r * K, q + r * K);
    return 0;
}

#define QBLOCK 4 /* queries per attention work item (a multiple of QPASS) */

/* Checks the model fits the fixed-size parts below; 0 ok. */
/* Whether b keeps the same inputs as a (the matrices reading one quantized input must). */
static int same_kept(const tr_qmat *a, const tr_qmat *b)
{
    return a->n_kept == b->n_kept && (!a->n_kept || !memcmp(a->kept, b->kept, a->n_kept * sizeof(int32_t)));
}

int trserve_forward_check(const tr_model *M)
{
    if (M->head_dim % 32 || M->head_dim > 256 || M->hidden % 32 || M->inter % 32 || M->heads % M->kv_heads) return -1;
    for (int64_t l = 0; l < M->n_layers; l++) {
        const tr_layer *L = M->layers + l;
        const tr_qmat *all[] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down, &M->head};
        for (int i = 0; i < 8; i++)
            if (all[i]->n_kept < 0 || all[i]->n_kept > MAX_KEPT || (all[i]->n_kept && (!M->arith || !all[i]->kept_w))
                || !KNOWN_KIND(all[i]->kind) || (KTWO(all[i]->kind) && all[i]->in % 256))
                return -1;
        if (!same_kept(&L->q, &L->k) || !same_kept(&L->q, &L->v) || !same_kept(&L->gate, &L->up)) return -1;
        for (int64_t g = 0; L->key_pair && g < M->kv_heads; g++)
            if (!M->arith || L->key_pair[g] < 0 || L->key_pair[g] >= M->head_dim / 2) return -1;
        if (L->window < 0 || L->rope_table < 0 || L->rope_table > 1 || (L->rope_table && !M->cos_local)) return -1;
    }
    if (M->rotary_dim < 0 || M->rotary_dim > M->head_dim || M->rotary_dim % 2) return -1;
    if (M->act < 0 || M->act > 1 || !(M->attn_softcap >= 0.0f) || !(M->final_softcap >= 0.0f)) return -1;
    return 0;
}

/* x += y [N, H], y a layer's attention or MLP output whose columns [o0, o1) this thread computed; with
 * a sandwich norm w (Gemma), x += RMSNorm_w(y) instead, each row normed whole by one thread once every
 * thread has written its columns. Ends at a barrier. */
static void residual(const float *w, float *x, float *y, int64_t N, int64_t H, float eps, int64_t id, int64_t nt,
                     int64_t o0, int64_t o1)
{
    if (w) {
        pool_barrier(nt);
        for (int64_t t = id; t < N; t += nt) {
            rms_rows(y, w, y, t, t + 1, H, eps);
            for (int64_t i = 0; i < H; i++) x[t * H + i] += y[t * H + i];
        }
    } else {
        for (int64_t t = 0; t < N; t++)
            for (int64_t i = o0; i < o1; i++) x[t * H + i] += y[t * H + i];
    }
    pool_barrier(nt);
}

typedef struct { /* trserve_forward's arguments and buffers, for the threads of its pool run */
    const tr_model *M;
    int64_t B, cap, n_keep, K, N, H, D, Hq, Hkv, F, sc_len, sc_floats;
    const int64_t *tok0, *ids, *pos, *kv_row, *ctx, *start, *keep, *vis0, *item0, *split;
    const uint8_t *vis;
    float *const *kc, *const *vc;
    float *logits, *x, *hs, *tmp, *q, *k, *v, *att, *gt, *up, *hk, *scs;
    int32_t *topk;
    uint8_t *probs, *wms; /* wms: each thread's QPASS mask rows of max_w bytes (sliding windows) */
    qact_t *acts;         /* int8 arithmetic: each thread's quantized activations */
    int64_t max_w;        /* the widest sequence's new tokens */
} fwd_job_t;

/* One thread's part of a forward (id of nt; pool_barrier where every thread must have finished a phase). */
static void fwd_job(void *arg, int64_t id, int64_t nt)
{
    const fwd_job_t *jb = arg;
    const tr_model *M = jb->M;
    const int64_t B = jb->B, cap = jb->cap, n_keep = jb->n_keep, K = jb->K, N = jb->N, H = jb->H, D = jb->D, Hq = jb->Hq,
                  Hkv = jb->Hkv, F = jb->F, sc_len = jb->sc_len, sc_floats = jb->sc_floats;
    const int64_t R = M->rotary_dim ? M->rotary_dim : D; /* rotary dims: the tables' row width */
    const int64_t *tok0 = jb->tok0, *pos = jb->pos, *kv_row = jb->kv_row, *ctx = jb->ctx, *start = jb->start,
                  *keep = jb->keep, *vis0 = jb->vis0, *item0 = jb->item0, *split = jb->split;
    const uint8_t *vis = jb->vis;
    float *const *kc = jb->kc, *const *vc = jb->vc;
    float *logits = jb->logits, *x = jb->x, *hs = jb->hs, *tmp = jb->tmp, *q = jb->q, *k = jb->k, *v = jb->v,
          *att = jb->att, *gt = jb->gt, *up = jb->up, *hk = jb->hk, *scs = jb->scs;
    int32_t *topk = jb->topk;
    float *sc = scs + id * sc_floats, *h = hs + id * N * H;
    qact_t *act = jb->acts + id;
    int64_t o0, o1;
    PHASES_START;
    for (int64_t l = 0; l < M->n_layers; l++) {
        const tr_layer *L = M->layers + l;
        rms_rows(x, L->in_norm, h, 0, N, H, M->eps);
        lin_quant(M, &L->q, h, N, H, act);
        lin(M, &L->q, h, act, N, q, id, nt, &o0, &o1);
        lin(M, &L->k, h, act, N, k, id, nt, &o0, &o1);
        lin(M, &L->v, h, act, N, v, id, nt, &o0, &o1);
        pool_barrier(nt);
        PHASE(PH_QKV);
        /* per-head norms (Qwen3) then rotary on q and k; k, v into the KV rows (work item u = token t,
         * head j of q then k) */
        for (int64_t u = id; u < N * (Hq + Hkv); u += nt) {
            const int64_t t = u / (Hq + Hkv), j = u % (Hq + Hkv);
            const float *c = (L->rope_table ? M->cos_local : M->cos) + pos[t] * R,
                        *s = (L->rope_table ? M->sin_local : M->sin) + pos[t] * R;
            if (j < Hq) {
                head_norm(q + (t * Hq + j) * D, L->q_norm, D, L->q_eps);
                rope(q + (t * Hq + j) * D, c, s, R);
                continue;
            }
            int64_t b = 0;
            while (tok0[b + 1] <= t) b++;
            const int64_t g = j - Hq, at = ((kv_row[b] * Hkv + g) * cap + start[b] + (t - tok0[b])) * D;
            if (M->arith) { /* the int8 arithmetic's KV buffers hold float16: key slots (ikeys.h), float16 values */
                float kr[256];
                memcpy(kr, k + (t * Hkv + g) * D, D * sizeof(float));
                head_norm(kr, L->k_norm, D, L->k_eps);
                rope(kr, c, s, R);
                ikey_write(kr, D, L->key_pair ? L->key_pair[g] : -1, (uint8_t *)((uint16_t *)kc[l] + at));
                for (int64_t i = 0; i < D; i += 16) v_to_half(v + (t * Hkv + g) * D + i, (uint16_t *)vc[l] + at + i);
                continue;
            }
            memcpy(kc[l] + at, k + (t * Hkv + g) * D, D * sizeof(float));
            head_norm(kc[l] + at, L->k_norm, D, L->k_eps);
            rope(kc[l] + at, c, s, R);
            memcpy(vc[l] + at, v + (t * Hkv + g) * D, D * sizeof(float));
        }
        pool_barrier(nt);
        PHASE(PH_ROPE);
        /* work items: (sequence, head, block of QBLOCK queries), item0[b] = sequence b's first; each
         * thread the contiguous range [split[id], split[id + 1]) of about equal cost (attention_split),
         * so the heads that share a KV head mostly share its reads */
        for (int64_t u = split[id], u1 = split[id + 1], b = 0; u < u1; u++) {
            while (item0[b + 1] <= u) b++;
            const int64_t w = tok0[b + 1] - tok0[b], blocks = (w + QBLOCK - 1) / QBLOCK, r = u - item0[b];
            const int64_t hd = r / blocks, i0 = (r % blocks) * QBLOCK;
            attend(M, b, hd, i0, i0 + QBLOCK < w ? i0 + QBLOCK : w, tok0, ctx, start, kv_row, pos, L->window, vis,
                   vis0, q, kc[l], vc[l], L->key_pair, cap, att, sc, sc_len, jb->wms + id * QPASS * jb->max_w);
        }
        pool_barrier(nt);
        PHASE(PH_ATTENTION);
        lin_quant(M, &L->o, att, N, Hq * D, act);
        lin(M, &L->o, att, act, N, tmp, id, nt, &o0, &o1);
        residual(L->attn_out_norm, x, tmp, N, H, M->eps, id, nt, o0, o1);
        PHASE(PH_O);
        rms_rows(x, L->post_norm, h, 0, N, H, M->eps);
        lin_quant(M, &L->gate, h, N, H, act);
        lin(M, &L->gate, h, act, N, gt, id, nt, &o0, &o1);
        lin(M, &L->up, h, act, N, up, id, nt, &o0, &o1);
        for (int64_t t = 0; t < N; t++) /* act(gate) * up on this thread's outputs */
            gated(M->act, gt + t * F + o0, up + t * F + o0, o1 - o0, sc);
        pool_barrier(nt);
        PHASE(PH_GATE_UP);
        lin_quant(M, &L->down, gt, N, F, act);
        lin(M, &L->down, gt, act, N, tmp, id, nt, &o0, &o1);
        residual(L->mlp_out_norm, x, tmp, N, H, M->eps, id, nt, o0, o1);
        PHASE(PH_DOWN);
    }
    /* final norm of the kept tokens, then the LM head */
    for (int64_t i = id; i < n_keep; i += nt) rms_rows(x + keep[i] * H, M->final_norm, hk + i * H, 0, 1, H, M->eps);
    pool_barrier(nt);
    if (n_keep) {
        lin_quant(M, &M->head, hk, n_keep, H, act);
        lin(M, &M->head, hk, act, n_keep, logits, id, nt, &o0, &o1);
        for (int64_t i = 0; M->final_softcap > 0.0f && i < n_keep; i++) /* this thread's outputs */
            softcap(logits + i * M->vocab + o0, o1 - o0, M->final_softcap);
    }
    if (K > 0) {
        pool_barrier(nt);
        PHASE(PH_HEAD);
        for (int64_t i = id; i < n_keep; i += nt) {
            topk_row(logits + i * M->vocab, M->vocab, K, topk + i * K);
            if (jb->probs) top_probs_row(logits + i * M->vocab, M->vocab, K, topk + i * K, jb->probs + i * K);
        }
        PHASE(PH_TOPK);
    } else {
        PHASE(PH_HEAD);
    }
}

/* Item r (0-based within its sequence) of a sequence of w new tokens over L cached keys: its block's
 * queries in passes of QPASS, each over L + w keys, plus a fixed part. */
INLINE double attention_item_cost(int64_t w, int64_t r, int64_t L)
{
    const int64_t blocks = (w + QBLOCK - 1) / QBLOCK, i0 = r % blocks * QBLOCK, nq = w - i0 < QBLOCK ? w - i0 : QBLOCK;
    return (double)(((nq + QPASS - 1) / QPASS) * (L + w) + 16);
}

/* The attention work items (sequence b, head, block of QBLOCK queries; item0[b] = b's first, heads
 * outer, blocks inner) split into nt contiguous ranges of about equal cost: thread id takes
 * [split[id], split[id + 1]). An item reads its sequence's ctx[b] + w keys once per pass of QPASS
 * queries, so a batch of rows with unequal contexts split by item count left one thread with the
 * long rows (2-core Zen 5, one-token steps over 4 rows of 50, 50, 200, 700 keys: 7.0-8.9 ms split
 * by cost, 9.0-9.6 by count, alternating runs). Which thread computes an item never changes its
 * arithmetic. */
static void attention_split(int64_t B, const int64_t *tok0, const int64_t *ctx, const int64_t *item0, int64_t nt,
                            int64_t *split)
{
    double total = 0.0, acc = 0.0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t u = item0[b]; u < item0[b + 1]; u++)
            total += attention_item_cost(tok0[b + 1] - tok0[b], u - item0[b], ctx[b]);
    int64_t id = 1;
    split[0] = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t u = item0[b]; u < item0[b + 1]; u++) {
            while (id < nt && acc >= total * (double)id / (double)nt) split[id++] = u;
            acc += attention_item_cost(tok0[b + 1] - tok0[b], u - item0[b], ctx[b]);
        }
    while (id <= nt) split[id++] = item0[B];
}

/* One forward. B sequences, tok0: [B + 1] token offsets; ids, pos: [N] (pos: rotary's, and a sliding
 * window's positions; context column c is position c); per sequence b: kv_row[b]
 * its KV row, ctx[b] its visible context columns [0, ctx[b]), start[b] the column its new tokens'
 * keys/values are written from; vis: per sequence a [w_b, w_b] uint8 matrix (1 = token i sees new
 * token j), concatenated. kc[l], vc[l]: layer l's buffers [R, Hkv, cap, D]. keep: [n_keep] token
 * indices whose logits are wanted -> logits [n_keep, V]; K > 0: also each kept row's top-K ids
 * (topk_row) -> topk [n_keep, K], and with probs, their confidences (top_probs_row) -> probs [n_keep, K]
 * (while the row is still in cache, on the pool's threads). Returns 0, -1 on a shape the check refuses,
 * -2 without memory, -3 on a position beyond the rotary tables. */
int trserve_forward(const tr_model *M, int64_t B, const int64_t *tok0, const int64_t *ids, const int64_t *pos,
                    const int64_t *kv_row, const int64_t *ctx, const int64_t *start, const uint8_t *vis,
                    float *const *kc, float *const *vc, int64_t cap, const int64_t *keep, int64_t n_keep,
                    float *logits, int64_t K, int32_t *topk, uint8_t *probs, int threads)
{
    if (trserve_forward_check(M) || threads < 1 || K < 0 || K > 64 || K > M->vocab || (K && n_keep && !topk)) return -1;
#ifdef TR_PHASES
    const double t_call = now_s();
#endif
    const int64_t N = tok0[B], H = M->hidden, D = M->head_dim, Hq = M->heads, Hkv = M->kv_heads, F = M->inter;
    int64_t max_ctx = 0, max_w = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t w = tok0[b + 1] - tok0[b];
        max_w = w > max_w ? w : max_w;
        max_ctx = ctx[b] > max_ctx ? ctx[b] : max_ctx;
    }
    for (int64_t t = 0; t < N; t++)
        if (pos[t] < 0 || pos[t] >= M->positions) return -3;
    const int64_t sc_len = max_ctx + max_w + 1, sc_floats = QPASS * sc_len > F ? QPASS * sc_len : F;
    int64_t *vis0 = malloc((B + 1) * sizeof(int64_t)), *item0 = malloc((B + 1) * sizeof(int64_t)),
            *split = malloc((threads + 1) * sizeof(int64_t));
    /* h: each thread's own normed copy of x (every thread norms all rows: N x H work, which saves a
     * barrier per norm) */
    float *x = malloc(sizeof(float) * (N * H)), *hs = malloc(sizeof(float) * (N * H * threads)),
          *tmp = malloc(sizeof(float) * (N * H)), *q = malloc(sizeof(float) * (N * Hq * D)),
          *k = malloc(sizeof(float) * (N * Hkv * D)), *v = malloc(sizeof(float) * (N * Hkv * D)),
          *att = malloc(sizeof(float) * (N * Hq * D)), *gt = malloc(sizeof(float) * (N * F)),
          *up = malloc(sizeof(float) * (N * F)), *hk = malloc(sizeof(float) * (n_keep * H + 1)),
          *scs = malloc(sizeof(float) * (sc_floats * threads));
    int rc = 0;
    /* int8: each thread's quantized activations, for the widest input of the most rows */
    qact_t *acts = calloc(threads, sizeof(qact_t));
    uint8_t *wms = malloc(threads * QPASS * max_w + 1);
    const int64_t widest = F > Hq * D ? (F > H ? F : H) : (Hq * D > H ? Hq * D : H);
    int acts_ok = acts != NULL;
    for (int t = 0; M->arith && acts_ok && t < threads; t++) acts_ok = !qact_alloc(acts + t, N > n_keep ? N : n_keep, widest);
    if (!(vis0 && item0 && split && x && hs && tmp && q && k && v && att && gt && up && hk && scs && acts_ok && wms)) {
        rc = -2;
        goto done;
    }
    vis0[0] = item0[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t w = tok0[b + 1] - tok0[b];
        vis0[b + 1] = vis0[b] + w * w;
        item0[b + 1] = item0[b] + Hq * ((w + QBLOCK - 1) / QBLOCK);
    }
    attention_split(B, tok0, ctx, item0, threads, split);
    for (int64_t t = 0; t < N; t++) /* x * 1 is x: a scale of 1 leaves the rows' bits */
        for (int64_t i = 0; i < H; i++) x[t * H + i] = M->embed[ids[t] * H + i] * M->embed_scale;
    {
        fwd_job_t job = {M, B, cap, n_keep, K, N, H, D, Hq, Hkv, F, sc_len, sc_floats, tok0, ids, pos, kv_row, ctx,
                         start, keep, vis0, item0, split, vis, kc, vc, logits, x, hs, tmp, q, k, v, att, gt, up, hk,
                         scs, topk, K > 0 ? probs : NULL, wms, acts, max_w};
        pool_run(fwd_job, &job, threads);
    }
#ifdef TR_PHASES
    phase_s[PH_CALL] += now_s() - t_call;
    phase_calls++;
#endif
done:
    for (int t = 0; acts && t < threads; t++) qact_free(acts + t);
    free(acts);
    free(vis0), free(item0), free(split), free(x), free(hs), free(tmp), free(q), free(k), free(v), free(att), free(gt), free(up), free(hk);
    free(scs), free(wms);
    return rc;
}
