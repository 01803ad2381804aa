"""Which Phi-3 checkpoints the loader splits into the Llama they compute (engine/model/checkpoint.py:
as_llama), and why the others stay Phi-3 (the reason native.native_unsupported reports); and partial
rotary (Phi-4-mini's partial_rotary_factor 0.75: the first 3/4 of each head rotated) on the split Llama:
its rotary dims (`rotary_dims`, what csrc/forward.c's tr_model.rotary_dim holds) and Phi-3's rotary
application on transformers' Llama modules (`partial_attention`), which rotate whole heads."""

from __future__ import annotations

import functools
import types


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
