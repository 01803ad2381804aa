"""A Gemma 2 or Gemma 3 GGUF file's hyperparameters as llama.cpp reads them, in transformers' config.

transformers' GGUF map (integrations/ggml.py) reads a Gemma file's shape, rope base and sliding window,
and leaves the rest at Gemma2Config's / Gemma3TextConfig's defaults, which are the released models'
(query_pre_attn_scalar 256, Gemma 3's local rope base 10,000 and every sixth layer global, no rope
scaling) and not what the file says or what llama.cpp runs it with. llama.cpp
(src/models/gemma2.cpp, gemma3.cpp: load_arch_hparams; llama-model.cpp for the rope keys) reads:

- attention scale 1 / sqrt(head dim) (`attention.key_length`), or 1 / sqrt(hidden / heads) for the 27B
  models (46 layers: Gemma 2; 62: Gemma 3), the rule of gemma_pytorch's configs it follows; here
  query_pre_attn_scalar (transformers scales by its -1/2 power);
- the sliding window `attention.sliding_window` (Gemma 2: 4096 where absent; Gemma 3: none, every layer
  global) over the layers `attention.sliding_window_pattern` marks (a bool per layer, or n: layer i local
  iff i % n < n - 1; where absent n = 2 for Gemma 2, 6 for Gemma 3);
- Gemma 2's soft-capping `attn_logit_softcapping` (default 50) and `final_logit_softcapping` (30);
  Gemma 3's final one only where the file has it (none by default), and no attention soft-capping;
- rope: `rope.freq_base` (10,000 where absent) with `rope.scaling.type` / `rope.scaling.factor`
  (linear: positions / factor) on Gemma 2's every layer and Gemma 3's global layers; Gemma 3's local
  layers `rope.freq_base_swa` (10,000 where absent), unscaled. Gemma 2 has one rope in transformers, so
  a file giving its local layers another base is refused, as is rope scaling other than linear.

The norms' (1 + w) storage and the tied, sqrt(hidden)-scaled embedding are transformers' own
(Gemma2TensorProcessor subtracts the 1; Gemma's scaled embedding module): no config of them here.
"""

from __future__ import annotations

from ...core.errors import FailedPrecondition

GEMMA_ARCHS = ("gemma2", "gemma3")
_LARGE = {"gemma2": 46, "gemma3": 62}  # layers of the 27B models (llama.cpp's LLM_TYPE_27B)


def _reader(meta: dict, arch: str):
    def value(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)
    return value


def local_layers(n: int, pattern) -> list[bool]:
    """Which of n layers slide, as llama.cpp's load_swa_pattern: a bool per layer, or every layer i with
    i % pattern < pattern - 1 (pattern 0: all)."""
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n:
            raise FailedPrecondition(f"sliding_window_pattern has {len(pattern)} entries for {n} layers")
        return [bool(p) for p in pattern]
    p = int(pattern)
    return [p == 0 or i % p < p - 1 for i in range(n)]


def _rope(value, arch: str) -> dict:
    """The global layers' rope (transformers' rope_parameters entry) from the file's rope keys."""
    base = float(value("rope.freq_base", 10000.0))
    kind = value("rope.scaling.type", "linear")
    factor = float(value("rope.scaling.factor", value("rope.scale_linear", 0.0)) or 0.0)
    if factor in (0.0, 1.0) and kind in ("linear", "none"):
        return {"rope_type": "default", "rope_theta": base}
    if kind != "linear":
        raise FailedPrecondition(f"{arch} file with rope scaling {kind!r}: this server reads linear scaling only")
    return {"rope_type": "linear", "factor": factor, "rope_theta": base}


def gemma_config(config, meta: dict, arch: str):
    """`config` (transformers' Gemma2Config or Gemma3TextConfig read from a GGUF file whose metadata is
    `meta`, values by key, general.architecture `arch`) rebuilt with the hyperparameters llama.cpp reads
    from it."""
    value = _reader(meta, arch)
    n, gemma2 = config.num_hidden_layers, arch == "gemma2"
    large = n == _LARGE[arch]
    out = {"query_pre_attn_scalar": config.hidden_size // config.num_attention_heads if large else config.head_dim}
    window = int(value("attention.sliding_window", 4096 if gemma2 else 0) or 0)
    local = local_layers(n, value("attention.sliding_window_pattern", 2 if gemma2 else 6)) if window else [False] * n
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in local]
    if window:
        out["sliding_window"] = window
    rope = _rope(value, arch)
    swa_base = value("rope.freq_base_swa")
    if gemma2:
        if swa_base is not None and float(swa_base) != rope["rope_theta"]:
            raise FailedPrecondition(f"gemma2 file with local layers' rope base {swa_base} beside "
                                     f"{rope['rope_theta']}: transformers' Gemma 2 has one rope")
        out.update(attn_logit_softcapping=float(value("attn_logit_softcapping", 50.0)),
                   final_logit_softcapping=float(value("final_logit_softcapping", 30.0)), rope_parameters=rope)
    else:
        cap = float(value("final_logit_softcapping", 0.0) or 0.0)
        out.update(attn_logit_softcapping=None, final_logit_softcapping=cap or None, rope_parameters={
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": float(swa_base or 10000.0)}})
    return type(config).from_dict({**config.to_dict(), **out})
