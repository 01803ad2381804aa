"""Which Phi-3 checkpoints (and files, engine/model/gguf_phi3.py) the loader splits into the Llama they
compute (`as_llama`), and why the others stay Phi-3 (the reason native.native_unsupported reports); and partial
rotary (Phi-4-mini's partial_rotary_factor 0.75: the first 3/4 of each head rotated) on the split Llama:
its rotary dims (`rotary_dims`, what csrc/forward.c's tr_model.rotary_dim holds) and Phi-3's rotary
application on transformers' Llama modules (`partial_attention`), which rotate whole heads."""

from __future__ import annotations

import functools
import logging
import types

log = logging.getLogger("trserve.engine")


def partial_factor(config) -> float:
    """The share of each head rotary turns (1.0: whole heads), as transformers' rope init reads it."""
    rope = getattr(config, "rope_parameters", None) or {}  # Gemma 3: one dict per layer type (no factor)
    p = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    return float(p if p is not None else getattr(config, "partial_rotary_factor", None) or 1.0)


def rotary_dims(config) -> int:
    """R: the dims of each head rotary turns, int(head_dim * partial) (transformers' rope init: its
    inv_freq holds R / 2 frequencies, the tables R columns); head_dim where whole heads turn."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * partial_factor(config))


def rotary_unsupported(body, config, head_dim: int) -> str | None:
    """Why a decoder's rotary module's tables are not the R = `rotary_dims` columns csrc/forward.c rotates
    (None: they are, or the module has no single table, Gemma 3's): 2 x its inv_freq, R even, 0 < R <= D."""
    inv, r = getattr(getattr(body, "rotary_emb", None), "inv_freq", None), rotary_dims(config)
    width = 2 * inv.numel() if hasattr(inv, "numel") else r
    if width != r or r % 2 or not 0 < r <= head_dim:
        return f"rotary tables {width} wide for {r} rotary dims of head_dim {head_dim}"
    return None


def phi3_kept(model_config, native: bool = True) -> str | None:
    """Why a Phi-3 config is not split into a Llama (None: it is). Partial rotary (Phi-4-mini) is split
    only with longrope (transformers' Llama's default rope init ignores partial_rotary_factor; its
    longrope init honours it) and only where the native forward may run it (`native`: the forward not
    asked to be transformers'); rope types other than default and longrope are not Llama's."""
    rope = getattr(model_config, "rope_parameters", None) or {}
    partial, kind = partial_factor(model_config), rope.get("rope_type", "default")
    if kind not in ("default", "longrope"):
        return f"rotary embedding type {kind!r}"
    if partial != 1.0 and kind != "longrope":
        return f"partial rotary (partial_rotary_factor {partial}) without longrope"
    if partial != 1.0 and not native:
        return f"partial rotary (partial_rotary_factor {partial}) with transformers' forward asked for"
    return None


def partial_attention(model) -> None:
    """Each attention module of a Llama (or Mistral) split from a partial-rotary Phi-3 given Phi-3's
    rotary application (transformers' modeling_phi3.apply_rotary_pos_emb: the first R dims turned as
    rotary pairs (i, i + R/2), the rest passed through; the rotary tables are [P, R]), so transformers'
    forward of the split model computes Phi-3's (calibration, the transformers fallback)."""
    for layer in model.get_decoder().layers:
        layer.self_attn.__class__ = _partial_class(type(layer.self_attn))


@functools.cache
def _partial_class(cls: type) -> type:
    """cls with its forward's own code run with Phi-3's apply_rotary_pos_emb in the place of its module's."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    f = cls.forward
    if "apply_rotary_pos_emb" not in f.__code__.co_names:
        raise TypeError(f"{cls.__name__}.forward does not call apply_rotary_pos_emb: partial rotary cannot be given it")
    scope = dict(f.__globals__, apply_rotary_pos_emb=apply_rotary_pos_emb)
    forward = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__, f.__closure__)
    forward.__kwdefaults__ = f.__kwdefaults__
    return type(f"PartialRotary{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})


def as_llama(model_config, native: bool = True):
    """(the config of the Llama, or Mistral where windowed, that a Phi-3 checkpoint computes; its split
    rows: name -> (fused tensor, a, b)), or (model_config, {}) for any other model. Phi-3 is Llama's
    function with q/k/v and gate/up fused into one weight each (transformers' modeling_phi3.py); split
    at load, it takes the native forward. Longrope (Phi-3.5-mini) keeps its rope parameters (transformers'
    Llama computes them as Phi-3 does); so does partial rotary (Phi-4-mini, with longrope), its
    partial_rotary_factor kept (the rotary tables R = head_dim * factor wide), where the native forward
    may run it (`native`; phi3.partial_attention gives the Llama's modules Phi-3's partial rotary)."""
    from transformers import LlamaConfig, MistralConfig

    rope = getattr(model_config, "rope_parameters", None) or {}
    if model_config.model_type != "phi3":
        return model_config, {}
    why = phi3_kept(model_config, native)
    if why:
        log.info("Phi-3 checkpoint kept with its fused layers, on transformers' modules: %s", why)
        return model_config, {}
    c = model_config
    shape = {k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                         "rms_norm_eps", "tie_word_embeddings", "hidden_act", "bos_token_id",
                                         "eos_token_id", "pad_token_id")}
    shape["rope_parameters"] = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
    if rope.get("rope_type") == "longrope":
        shape["rope_parameters"] = {k: v for k, v in rope.items() if k not in ("type", "partial_rotary_factor")}
        if partial_factor(c) != 1.0:  # Phi-4-mini: its rotary tables R wide (phi3.rotary_dims)
            shape["rope_parameters"]["partial_rotary_factor"] = partial_factor(c)
    window = getattr(c, "sliding_window", None)
    config = MistralConfig(sliding_window=window, **shape) if window else LlamaConfig(**shape)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, inter, rows = c.num_attention_heads * hd, c.num_key_value_heads * hd, c.intermediate_size, {}
    for i in range(c.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for name, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
            rows[f"{a}{name}_proj.weight"] = (f"{a}qkv_proj.weight", lo, hi)
        rows[f"{m}gate_proj.weight"] = (f"{m}gate_up_proj.weight", 0, inter)  # chunk(2): gate first
        rows[f"{m}up_proj.weight"] = (f"{m}gate_up_proj.weight", inter, 2 * inter)
    return config, rows
