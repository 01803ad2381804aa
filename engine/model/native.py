"""The native forward: a llama-family model's whole decoder stack in one C call (csrc/forward.c).

With transformers' eager modules a forward of SmolLM2-135M dispatches ~2,000 small ops (norms,
rotary, views, cache updates, 7 kernel calls per layer with an OpenMP fork/join each): ~8-10 ms per
forward on these CPUs, as much as the weights' memory traffic. `NativeForward` runs the same model
(the weights transformers loaded, as the exact compressed kernels hold them: engine/model/kernels/)
in one run of the kernels' thread pool (csrc/pool.h) over a packed batch: B sequences' new tokens back to back, no padding, each
with its own KV row, visible context, write column and tree mask.

It applies where the model is the Llama architecture as transformers defines it (LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM): pre-norm RMSNorm, rotary embedding with a
static table, grouped-query attention, SiLU-gated MLP, every linear layer on compressed kernels; Qwen3's
per-head RMSNorm of queries and keys (self_attn.q_norm, k_norm: after q_proj / k_proj, before
rotary) runs in C where a layer has them, and so do sliding windows (Mistral v0.1's sliding_window
on every layer; Qwen2/Qwen3's "sliding_attention" layers, with use_sliding_window and
max_window_layers): each layer's window (`layer_windows`) masks keys by position in C, as transformers'
masks do, while the KV rows keep every column (BatchKV). Gemma 2 and 3 (Gemma2ForCausalLM,
Gemma3ForCausalLM) take it too: GeGLU, (1 + w) norms (`_norm`), the attention's and MLP's outputs
normed before each residual add, scaled embeddings, Gemma 3's local rotary table for its sliding
layers, Gemma 2's attention and final logit soft-capping. Anything else keeps transformers' forward
(engine/model/runner.py decides). Every token's numbers depend
only on its input, position and visible keys (see csrc/forward.c), so tree verification and plain
decoding give identical logits, and the AVX-512, AVX2 and scalar builds give the same bits; against
transformers' own forward the logits differ by float rounding (~1e-5; tests check both).
"""

from __future__ import annotations

import ctypes

import torch

from .embedding import FileEmbedding
from .kernels.build import forward_check_library, forward_library, top_probs_library
from .kernels.qlinear import QLinear
from .phi3 import phi3_kept, rotary_dims, rotary_unsupported

_i64 = ctypes.c_int64
_P = ctypes.c_void_p


class _QMat(ctypes.Structure):
    _fields_ = [("kind", _i64), ("inp", _i64), ("out", _i64), ("codes", _P), ("d", _P), ("m", _P), ("bias", _P),
                ("n_kept", _i64), ("kept", _P), ("kept_w", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _P), ("post_norm", _P), *((n, _QMat) for n in ("q", "k", "v", "o", "gate", "up", "down")),
                ("key_pair", _P), ("q_norm", _P), ("k_norm", _P), ("q_eps", ctypes.c_float), ("k_eps", ctypes.c_float),
                ("window", _i64), ("attn_out_norm", _P), ("mlp_out_norm", _P), ("rope_table", _i64)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("inter", _i64), ("vocab", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("embed", _P), ("final_norm", _P), ("layers", ctypes.POINTER(_Layer)), ("head", _QMat),
                ("cos", _P), ("sin", _P), ("positions", _i64), ("arith", _i64), ("act", _i64),
                ("embed_scale", ctypes.c_float), ("attn_softcap", ctypes.c_float), ("final_softcap", ctypes.c_float),
                ("cos_local", _P), ("sin_local", _P), ("rotary_dim", _i64)]


ARITH_CODES = {"exact": 0, "int8": 1}  # tr_model.arith (csrc/forward.h)
_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
          "Gemma3ForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")  # sandwich norms, (1 + w) norms, GeGLU, scaled embeddings
_LAYER_TYPES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", *_GEMMA)  # windows from config.layer_types
_STATIC_ROPE = ("default", "linear", "llama3", "longrope")  # longrope: static below rope_positions
_ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}  # tr_model.act


def rope_positions(config) -> int | None:
    """How many positions a model's rotary table is static over (None: all). Longrope (Phi-3.5, Phi-4-mini)
    is transformers' one exception: each forward takes the long factors for every position when its
    deepest position reaches original_max_position_embeddings, and the short ones otherwise, while its KV
    cache keeps keys rotated either way; so a sequence crossing that length gets other numbers from
    each way of splitting it into forwards (TR's trees against plain steps) and no server can equal
    transformers there. Below it every forward takes the short factors: the engine serves up to it
    (engine/target.py), and the native forward's table holds the short factors' rows."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope":
        return None
    return int(rope["original_max_position_embeddings"])


def native_unsupported(model) -> str | None:
    """Why `model` cannot take the native forward (None: it can)."""
    cfg = model.config
    arch = type(model).__name__
    if arch == "Phi3ForCausalLM":  # Phi-3 the checkpoint loader did not split into a Llama
        return f"Phi-3 with fused q/k/v and gate/up ({phi3_kept(cfg) or 'not split at load'})"
    if arch not in _ARCHS:
        return f"architecture {arch} (native forward: {', '.join(_ARCHS)})"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "not a CPU float32 model"
    if _activation(model) is None or getattr(cfg, "pretraining_tp", 1) != 1:
        return "activation or tensor-parallel layout differs from Llama's and Gemma's"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    _, why = layer_windows(model)
    if why:
        return why
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    body = model.get_decoder()
    if arch in _GEMMA and not isinstance(getattr(body.embed_tokens, "embed_scale", None), torch.Tensor):
        return "a Gemma embedding without its scale"
    rope = getattr(getattr(body, "rotary_emb", None), "rope_type", None)  # Gemma 3: one per layer type
    if not set(rope.values() if isinstance(rope, dict) else [rope]) <= set(_STATIC_ROPE):
        return f"rotary embedding type {rope!r} (native forward: {', '.join(_STATIC_ROPE)})"
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if why := rotary_unsupported(body, cfg, head_dim):
        return why
    if head_dim % 32 or head_dim > 256 or cfg.hidden_size % 32 or cfg.intermediate_size % 32 or heads % kv:
        return "head, hidden or MLP sizes not multiples of 32"
    for layer in body.layers:
        a, m = layer.self_attn, layer.mlp
        why = _qk_norms_unsupported(a, head_dim) or _norms_unsupported(layer, arch in _GEMMA)
        if why:
            return why
        mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        if not all(isinstance(x, QLinear) for x in mods):
            return "not every linear layer is on the compressed kernels"
        if getattr(a, "scaling", None) is None:
            return "attention scaling unknown"
    head = model.get_output_embeddings()
    if not isinstance(head, QLinear):
        return "LM head not on the compressed kernels"
    if any(isinstance(x, QLinear) and x.arithmetic != head.arithmetic for x in model.modules()):
        return "linear layers in more than one arithmetic"
    return None


def layer_windows(model) -> tuple[list[int], str | None]:
    """Each decoder layer's sliding window as transformers' modules apply it (0: full attention), and
    None; or ([], why) where they cannot be mirrored exactly. The window is in the mask transformers
    builds each forward (masking_utils.sliding_window_overlay: key position k visible from query
    position p iff k > p - window), from config.sliding_window for every layer of a Mistral, and for
    the layers a Qwen2/Qwen3 or Gemma 2/3 config's layer_types calls "sliding_attention" (Qwen's config
    derives them from use_sliding_window and max_window_layers: layers i >= max_window_layers slide;
    Gemma's alternate local and global layers). A config
    edited after the modules were built (an attention whose own sliding_window disagrees), a Mistral
    with layer_types (its modules ignore them), per-layer config overrides, other layer types, or
    windows on a Llama are refused: each would leave the numbers to guesswork."""
    cfg, arch = model.config, type(model).__name__
    n = len(model.get_decoder().layers)
    size, types = getattr(cfg, "sliding_window", None), getattr(cfg, "layer_types", None)
    if getattr(cfg, "is_heterogeneous", False):
        return [], "per-layer config overrides"
    if size is not None and (not isinstance(size, int) or size < 1):
        return [], f"sliding window {size!r}"
    if arch == "MistralForCausalLM":
        if types is not None:
            return [], "layer_types on a Mistral config (its modules give every layer the sliding window)"
        windows = [size or 0] * n
    elif arch in _LAYER_TYPES:
        types = list(types) if types is not None else ["full_attention"] * n
        if len(types) != n or not set(types) <= {"full_attention", "sliding_attention"}:
            return [], f"layer types {sorted(set(types))} over {n} layers"
        if "sliding_attention" in types and (size is None or getattr(cfg, "use_sliding_window", True) is False):
            return [], "sliding_attention layers without use_sliding_window and a sliding_window"
        windows = [size if t == "sliding_attention" else 0 for t in types]
    else:
        if size or "sliding_attention" in (types or ()):
            return [], "sliding-window attention on an architecture without it"
        windows = [0] * n
    for i, layer in enumerate(model.get_decoder().layers):
        own = getattr(layer.self_attn, "sliding_window", None)  # Qwen2/Qwen3: set from layer_types when built
        if hasattr(layer.self_attn, "sliding_window") and (own or 0) != windows[i]:
            return [], f"layer {i}'s attention has sliding window {own}, its config {windows[i] or None}"
    return windows, None


def _activation(model) -> int | None:
    """The gated MLP's activation as tr_model.act (None: one the C forward does not compute). Gemma's
    configs name it hidden_activation (its MLP reads that), the others hidden_act."""
    cfg = model.config
    name = cfg.hidden_activation if type(model).__name__ in _GEMMA else getattr(cfg, "hidden_act", "silu")
    return _ACTS.get(name)


_NORMS = {"LlamaRMSNorm": "w", "MistralRMSNorm": "w", "Qwen2RMSNorm": "w", "Qwen3RMSNorm": "w",
          "Gemma2RMSNorm": "1+w", "Gemma3RMSNorm": "1+w"}  # y = w * normed(x), or (1 + w) * normed(x)


def _norm(norm) -> tuple[torch.Tensor, float]:
    """An RMSNorm as csrc/forward.c applies it, weight * (x * (1 / sqrt(mean(x^2) + eps))): (its weight
    [n], its epsilon). Gemma's norms multiply by (1 + w) computed in float32 after the normalisation
    (Gemma3RMSNorm: x * rsqrt(...) then * (1.0 + weight.float())): that float32 sum, folded once here, is
    the same number its forward forms every call."""
    if _NORMS.get(type(norm).__name__) == "1+w":
        return 1.0 + norm.weight.detach().float(), float(norm.eps)
    eps = getattr(norm, "variance_epsilon", None)
    return norm.weight, eps


def _qk_norms_unsupported(attn, head_dim: int) -> str | None:
    """Why an attention's q/k norms are not the per-head RMSNorm csrc/forward.c applies (None: they
    are, or it has none): Qwen3's (w) or Gemma 3's (1 + w), a [head_dim] weight over each head
    (OLMo2's whole-projection norms would give other numbers, so they stay on transformers' forward)."""
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name, None)
        if norm is None:
            continue
        w = getattr(norm, "weight", None)
        if type(norm).__name__ not in ("Qwen3RMSNorm", "Gemma3RMSNorm") or w is None or \
                tuple(w.shape) != (head_dim,) or not isinstance(_norm(norm)[1], (int, float)):
            return f"{name} is not a per-head RMSNorm over head_dim {head_dim}"
    return None


def _norms_unsupported(layer, gemma: bool) -> str | None:
    """Why a Gemma decoder layer's norms are not the four csrc/forward.c applies (None: they are, or the
    layer is Llama's, whose two norms it always took): (1 + w) norms, input, post-attention and
    post-feedforward (on the attention's and the MLP's outputs), pre-feedforward (the MLP's input)."""
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm") if gemma else ():
        if _NORMS.get(type(getattr(layer, name, None)).__name__) != "1+w":
            return f"{name} is not the (1 + w) RMSNorm the native forward applies"
    return None


def _qmat(q: QLinear) -> _QMat:
    k = q.kept.numel()  # int8: inputs kept in float32 (engine/model/kernels/outliers.py)
    return _QMat(q.kind, q.in_features, q.out_features, q.codes.data_ptr(), q.d.data_ptr(),
                 q.m.data_ptr() if q.m.numel() else None, q.bias.data_ptr() if q.bias is not None else None,
                 k, q.kept.data_ptr() if k else None, q.kept_w.data_ptr() if k else None)


class NativeForward:
    """The forward of a supported model (see `native_unsupported`) over a BatchKV's buffers."""

    def __init__(self, model) -> None:
        why = native_unsupported(model)
        if why:
            raise ValueError(f"native forward unavailable: {why}")
        cfg, body = model.config, model.get_decoder()
        self.model = model
        head = model.get_output_embeddings()
        self._fn = forward_library(head.isa)
        self._probs = top_probs_library(head.isa)
        self.threads = head.threads  # as the linear layers (load_model sets them); None: torch.get_num_threads()
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self._keep = [model]  # every tensor whose pointer the C struct holds stays referenced here
        layers = (_Layer * len(body.layers))()
        self.windows = layer_windows(model)[0]  # per layer, 0: full attention
        self._rotary = body.rotary_emb
        rope = getattr(self._rotary, "rope_type", None)  # Gemma 3: local layers' table apart (rope_local_base_freq)
        self._rope_kinds = [None] if not isinstance(rope, dict) else \
            ["full_attention" if "full_attention" in rope else "sliding_attention", "sliding_attention"]
        local = [isinstance(rope, dict) and t == "sliding_attention" for t in getattr(cfg, "layer_types", None) or []]
        for i, layer in enumerate(body.layers):
            layers[i] = self._layer(i, layer, self.windows[i], int(local[i]) if local else 0)
        self._layers = layers
        self._ptrs = None  # (buffers' identity, layer key pointers, layer value pointers)
        self._tables = [torch.zeros(0)]
        gemma = type(model).__name__ in _GEMMA
        final, eps = _norm(body.norm)
        if eps is None:
            eps = cfg.rms_norm_eps
        attn_cap = getattr(cfg, "attn_logit_softcapping", None) if type(model).__name__ == "Gemma2ForCausalLM" else None
        scale = getattr(body.embed_tokens, "embed_scale", None) if gemma else None  # a FileEmbedding's too
        embed_scale = 1.0 if scale is None else scale.to(torch.float32)
        self.m = _Model(len(body.layers), cfg.hidden_size, self.heads, self.kv_heads, self.head_dim,
                        cfg.intermediate_size, head.out_features, float(eps), float(body.layers[0].self_attn.scaling),
                        self._embed_ptr(body.embed_tokens), self._ptr(final), layers, _qmat(head),
                        None, None, 0, ARITH_CODES[head.arithmetic], _activation(model), float(embed_scale),
                        float(attn_cap or 0.0), float(getattr(cfg, "final_logit_softcapping", None) or 0.0), None, None,
                        rotary_dims(cfg))  # R < head_dim: partial rotary (Phi-4-mini), tables [P, R]
        self._grow_rope(min(4096, rope_positions(cfg) or 4096))
        if forward_check_library(head.isa)(ctypes.byref(self.m)):
            raise ValueError("native forward unavailable: a shape its fixed-size parts do not take, kept inputs "
                             "that differ between layers reading one input (q, k, v; gate, up), or a kept key pair "
                             "out of range")
        self.arithmetic = head.arithmetic
        self.vocab = head.out_features

    def _layer(self, i: int, layer, window: int, rope_table: int) -> _Layer:
        """Decoder layer i as csrc/forward.h's tr_layer: its norms' weights, its 7 matrices, its kept key
        pairs (int8), its per-head q/k norms (Qwen3, Gemma 3; NULL pointers where it has none, which
        leaves the forward's arithmetic as it was for Llama's layers), each norm with its own epsilon,
        its sliding window (0: none, the forward as it was for full attention), Gemma's norms of the
        attention's and MLP's outputs (NULL: none) and its rotary table (1: Gemma 3's local one)."""
        a, m = layer.self_attn, layer.mlp
        sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma: the MLP's input norm is pre_feedforward's
        mlp_in = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        norms = (self._ptr(_norm(layer.input_layernorm)[0]), self._ptr(_norm(mlp_in)[0]))
        outs = (self._ptr(_norm(layer.post_attention_layernorm)[0]), self._ptr(_norm(layer.post_feedforward_layernorm)[0])) \
            if sandwich else (None, None)
        mats = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        pair = getattr(a.k_proj, "key_pair", None)  # int8: [kv_heads] int32 (kernels/outliers.py), or None
        if pair is not None:
            if pair.dtype != torch.int32 or pair.shape != (self.kv_heads,) or not pair.is_contiguous():
                raise ValueError(f"native forward unavailable: layer {i}'s kept key pairs are not "
                                 f"[{self.kv_heads}] int32")
            self._keep.append(pair)
        qk = [_norm(n) if n is not None else None for n in (getattr(a, "q_norm", None), getattr(a, "k_norm", None))]
        return _Layer(*norms, *(_qmat(x) for x in mats), pair.data_ptr() if pair is not None else None,
                      *(self._ptr(n[0]) if n is not None else None for n in qk),
                      *(float(n[1]) if n is not None else 0.0 for n in qk), window, *outs, rope_table)

    def _embed_ptr(self, embed) -> int:
        """The embedding table's pointer. A GGUF file's table (FileEmbedding) fills its rows as they are
        first looked up: each call ensures its ids' rows first (`_ensure`)."""
        if isinstance(embed, FileEmbedding):
            self._ensure = embed.ensure
            self._keep.append(embed.table)
            return embed.table.data_ptr()
        self._ensure = None
        return self._ptr(embed.weight)

    def _ptr(self, t: torch.Tensor) -> int:
        t = t.detach()
        if not t.is_contiguous() or t.dtype != torch.float32:
            t = t.contiguous().float()
        self._keep.append(t)  # a copy, or a tensor made for the forward (Gemma's 1 + w): alive while it is
        return t.data_ptr()

    def _grow_rope(self, need: int) -> None:
        """Rotary tables [P, R] (R = tr_model.rotary_dim: head_dim, or fewer with partial rotary) for
        positions 0..P-1 from the model's own rotary module: cos, sin, and
        Gemma 3's local layers' cos_local, sin_local (its module's table for "sliding_attention"); a
        longrope model's at most rope_positions (its short factors, as each of transformers' forwards
        below that takes)."""
        if need <= self._tables[0].shape[0]:
            return
        limit = rope_positions(self.model.config)
        if limit is not None and need > limit:
            raise ValueError(f"position {need - 1} past the {limit} positions this longrope model serves")
        p = max(need, 2 * self._tables[0].shape[0])
        p = p if limit is None else min(p, limit)
        pos, x = torch.arange(p)[None], torch.zeros(1, dtype=torch.float32)
        tables = []
        with torch.inference_mode():
            for kind in self._rope_kinds:
                cos, sin = self._rotary(x, pos) if kind is None else self._rotary(x, pos, kind)
                tables += [cos[0].contiguous().float(), sin[0].contiguous().float()]  # [P, R] each
        self._tables = tables
        self.m.cos, self.m.sin = tables[0].data_ptr(), tables[1].data_ptr()
        if len(tables) > 2:
            self.m.cos_local, self.m.sin_local = tables[2].data_ptr(), tables[3].data_ptr()
        self.m.positions = p

    def top_probs(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """logits [m, V] float32, ids [m, K] (column 0 the argmax) -> their softmax probabilities as
        uint8 buckets [m, K] (csrc/forward.c trserve_top_probs; engine/tr/recycle.py:top_probs is the
        torch form)."""
        x = logits.float().contiguous()
        idx = ids.to(torch.int32).contiguous()
        q = torch.empty(idx.shape, dtype=torch.uint8)
        if self._probs(x.data_ptr(), x.shape[0], x.shape[1], idx.shape[1], idx.data_ptr(), q.data_ptr()):
            raise RuntimeError(f"top_probs refused shapes {tuple(x.shape)}, {tuple(idx.shape)}")
        return q

    def __call__(self, kv_k: list[torch.Tensor], kv_v: list[torch.Tensor], widths: list[int], ids: torch.Tensor,
                 pos: torch.Tensor, kv_rows: list[int], ctx: list[int], start: list[int], vis: torch.Tensor,
                 keep: torch.Tensor | None, topk: int = 0,
                 probs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One forward. ids, pos: [N] int64 (sequences back to back, widths[b] each); vis: the
        sequences' [w_b, w_b] visibility (uint8) concatenated; keep: [m] token indices (None: all)
        -> (logits [m, V], each kept row's top-`topk` ids [m, topk] int32 or None for topk 0:
        largest first, equal logits by lower id, so column 0 is the argmax; with `probs` and topk > 0,
        their confidences [m, topk] uint8 as `top_probs` gives them, computed in the forward's pool
        while each row is in cache, else None). Writes each sequence's keys/values into kv row
        kv_rows[b] from column start[b]; it sees context columns [0, ctx[b])."""
        b, n = len(widths), int(ids.shape[0])
        self._grow_rope(int(pos.max()) + 1 if n else 1)
        tok0 = torch.zeros(b + 1, dtype=torch.int64)
        tok0[1:] = torch.tensor(widths, dtype=torch.int64).cumsum(0)
        meta = torch.tensor([kv_rows, ctx, start], dtype=torch.int64)  # [3, B]
        keep = keep.to(torch.int64).contiguous() if keep is not None else torch.arange(n, dtype=torch.int64)
        m = int(keep.shape[0])
        out = torch.empty(m, self.vocab, dtype=torch.float32)
        top = torch.empty(m, topk, dtype=torch.int32) if topk else None
        q = torch.empty(m, topk, dtype=torch.uint8) if topk and probs else None
        want = torch.float16 if self.arithmetic == "int8" else torch.float32  # what csrc/forward.c reads
        if kv_k[0].dtype != want or kv_v[0].dtype != want:
            raise ValueError(f"the native forward in {self.arithmetic} reads {want} KV buffers, got {kv_k[0].dtype}")
        key = (kv_k[0].data_ptr(), kv_v[0].data_ptr(), len(kv_k))  # the buffers change only when they grow
        if self._ptrs is None or self._ptrs[0] != key:
            self._ptrs = (key, (_P * len(kv_k))(*(t.data_ptr() for t in kv_k)),
                          (_P * len(kv_v))(*(t.data_ptr() for t in kv_v)))
        _, kp, vp = self._ptrs
        if self._ensure is not None:
            self._ensure(ids)
        ids, pos, vis = ids.contiguous(), pos.to(torch.int64).contiguous(), vis.to(torch.uint8).contiguous()
        cap = kv_k[0].shape[2]
        rc = self._fn(ctypes.byref(self.m), b, tok0.data_ptr(), ids.data_ptr(), pos.data_ptr(), meta[0].data_ptr(),
                      meta[1].data_ptr(), meta[2].data_ptr(), vis.data_ptr(), kp, vp, cap, keep.data_ptr(), m,
                      out.data_ptr(), topk, top.data_ptr() if top is not None else None,
                      q.data_ptr() if q is not None else None, self.threads or torch.get_num_threads())
        if rc == -2:
            raise MemoryError("native forward: out of memory")
        if rc:
            raise RuntimeError(f"native forward refused its input (code {rc})")
        return out, top, q
