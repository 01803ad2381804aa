/* The native forward's entry points and the model it reads (forward.c). engine/model/native.py
 * mirrors these structs with ctypes: a change here is a change there.
 */
#ifndef TRSERVE_FORWARD_H
#define TRSERVE_FORWARD_H

#include <stdint.h>

typedef struct {
    int64_t kind, in, out; /* qlinear.h's kinds, in/out features */
    const uint8_t *codes;
    const uint16_t *d, *m; /* the kind's scales and mins (qlinear.h); m only where it has a min */
    const float *bias;     /* [out] or NULL */
    int64_t n_kept;        /* int8 arithmetic: inputs kept in float32 (qlinear_i8.c), 0..16 */
    const int32_t *kept;   /* [n_kept] their indices (the same for the matrices sharing an input) */
    const float *kept_w;   /* [n_kept, out] W[:, kept] */
} tr_qmat;

typedef struct {
    const float *in_norm, *post_norm; /* [H] */
    tr_qmat q, k, v, o, gate, up, down;
    const int32_t *key_pair; /* int8: [kv_heads] the RoPE pair i (dims i, i + D/2) each KV head's keys keep in
                              * float32 (ikeys.h; engine/model/kernels/outliers.py), or NULL: none */
    const float *q_norm, *k_norm; /* [D] a per-head RMSNorm of each query / key head before rotary (Qwen3's
                                   * self_attn.q_norm, k_norm), or NULL: none (Llama, Mistral, Qwen2) */
    float q_eps, k_eps;           /* their epsilons */
    int64_t window;               /* sliding-window attention: a query at position p sees a key at position k
                                   * only where p - k < window (transformers' sliding_window_overlay); 0: every
                                   * key its mask allows (full attention) */
    const float *attn_out_norm, *mlp_out_norm; /* [H] Gemma's sandwich norms: an RMSNorm of the attention's
                                   * (o_proj's) and the MLP's (down_proj's) outputs before each residual add
                                   * (post_attention_layernorm, post_feedforward_layernorm; post_norm is then
                                   * its pre_feedforward_layernorm), or NULL: none (the Llama layout) */
    int64_t rope_table;           /* 0: the model's cos/sin, 1: its cos_local/sin_local (Gemma's local layers) */
} tr_layer;

typedef struct {
    int64_t n_layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    float eps, scale; /* RMSNorm epsilon, attention scaling */
    const float *embed;      /* [V, H] input embeddings */
    const float *final_norm; /* [H] */
    const tr_layer *layers;
    tr_qmat head;                    /* LM head */
    const float *cos, *sin;          /* [P, R] rotary tables by position (R: rotary_dim below) */
    int64_t positions;               /* P */
    int64_t arith;                   /* 0: exact (qlinear.c), 1: int8 (qlinear_i8.c; codes in its layout) */
    int64_t act;                     /* the gated MLP's activation: 0 SiLU, 1 GELU, tanh form (Gemma's GeGLU) */
    float embed_scale;               /* input embedding rows times this (Gemma: sqrt(hidden)); 1: as they are */
    float attn_softcap, final_softcap; /* cap * tanh(x / cap) on attention scores / logits (Gemma 2); 0: none */
    const float *cos_local, *sin_local; /* [P, R] a second rotary table (layers with rope_table 1), or NULL */
    int64_t rotary_dim;              /* R: the first R dims of each query / key head rotated, pairs (i, i + R/2),
                                      * dims R..D-1 passed through (partial rotary: Phi-4-mini's
                                      * partial_rotary_factor); the tables' rows are R wide. 0: D (whole heads) */
} tr_model;

/* Checks the model fits the forward's fixed-size parts; 0 ok. */
int trserve_forward_check(const tr_model *M);

/* The K largest of each of m rows of x [m, V] -> idx [m, K], largest first (tests). 0, or -1 when K
 * is not 1..64 or above V. */
int trserve_topk_rows(const float *x, int64_t m, int64_t V, int64_t K, int32_t *idx);
int trserve_to_half(const float *x, int64_t n, uint16_t *h);
int trserve_gated(int64_t act, float *g, const float *u, int64_t n, float *sc);
int trserve_top_probs(const float *x, int64_t m, int64_t V, int64_t K, const int32_t *idx, uint8_t *q);

/* One forward of B sequences' new tokens (packed, tok0 [B + 1] offsets) over their KV rows; logits of
 * the kept tokens (and their top-K ids for K > 0, and those ids' confidences where probs is not NULL). 0, -1 on a shape the check refuses, -2 without
 * memory, -3 on a position beyond the rotary tables. forward.c says what every argument holds. */
int trserve_forward(const tr_model *M, int64_t B, const int64_t *tok0, const int64_t *ids, const int64_t *pos,
                    const int64_t *kv_row, const int64_t *ctx, const int64_t *start, const uint8_t *vis,
                    float *const *kc, float *const *vc, int64_t cap, const int64_t *keep, int64_t n_keep,
                    float *logits, int64_t K, int32_t *topk, uint8_t *probs, int threads);

#endif
