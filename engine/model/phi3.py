"""Which Phi-3 checkpoints the loader splits into the Llama they compute (engine/model/checkpoint.py:
as_llama), and why the others stay Phi-3 (the reason native.native_unsupported reports): config only."""

from __future__ import annotations


def phi3_kept(model_config) -> str | None:
    """Why a Phi-3 config is not split into a Llama (None: it is). Partial rotary (Phi-4-mini's
    partial_rotary_factor 0.75) rotates the first part of each head only, which transformers' Llama
    cannot (it rotates whole heads); rope types other than default and longrope are not Llama's."""
    rope = getattr(model_config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(model_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        return f"partial rotary (partial_rotary_factor {partial}): transformers' Llama rotates whole heads"
    if rope.get("rope_type", "default") not in ("default", "longrope"):
        return f"rotary embedding type {rope.get('rope_type')!r}"
    return None
