"""Kept inputs of the int8 arithmetic (csrc/qlinear_i8.c): per linear layer, the few input dims that
reach far larger values than the rest (SmolLM2's hidden state has dims near |x| = 40 where the median
is 0.55), kept in float32 instead of quantized, so one of them does not coarsen its whole block of 32.

The set is fixed per layer input, chosen once per model from calibration prompts (never per batch,
so a row's outputs stay the same bits alone or in any batch): the KEPT dims with the largest |x| over
the prompts' tokens, in ascending order. Measured on 14 held-out Spec-Bench prompts x 64 tokens
(fake-quantized in torch): KL(exact || int8) 0.00284 with none, 0.00182 with 1, 0.00123 with 4,
0.00098 with 8; top-1 agreement 98.1% -> 98.8% with 4.

The sets are cached per calibration key (`kept-<key>.json` beside the converted model's cache): the
model fingerprint (vocabulary, family, shape) and a digest of the model's norm weights rounded to
bfloat16 (`calibration_key`). The fingerprint alone does not tell apart two models of one shape and
vocabulary (two pretrained models on Llama 3's tokenizer), whose activations peak in other dims; the
norms do, and they are stored unquantized in every GGUF type and checkpoint, so one model's files and
checkpoint (bfloat16, or float32 norms that hold bfloat16 values) share one set. The bundled model's
ship with the package (`kept/`), so every host serving it keeps the same inputs and gives the same
bits. For another model the first load on each host computes them in float32 torch: hosts agree
unless two dims' calibration maxima tie to float32 rounding (then copy one host's file to the others'
cache to be sure).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("trserve.engine")

KEPT = 4  # inputs kept per layer input
SHIPPED = Path(__file__).resolve().parent / "kept"
CALIBRATION_PROMPTS = 13  # the last first turn of each Spec-Bench category (trserve tune's, never the bench's)
MAX_TOKENS = 96  # per calibration prompt


def calibration_key(fingerprint: str, model: nn.Module) -> str:
    """What a calibration is cached under: `fingerprint` (loader.py:model_fingerprint) and the first 12 hex
    digits of a SHA-256 over the model's norm weights (`*norm*.weight`), by name, each rounded to
    bfloat16 (so float32 norms holding bfloat16 values, as converted files keep them, match their
    checkpoint's); the norms are filled before the linear layers on every load path."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        parts = name.rsplit(".", 2)
        if len(parts) > 1 and "norm" in parts[-2] and parts[-1] == "weight" and not p.is_meta:
            h.update(name.encode())
            h.update(p.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return f"{fingerprint}-n{h.hexdigest()[:12]}"


def kept_inputs(model: nn.Module, tokenizer, key: str, cache_dir: Path) -> dict[str, list[int]]:
    """Linear layer name -> the input dims it keeps in float32 (from the shipped or cached file of
    calibration key `key`, else calibrated now and cached)."""
    kept = _shipped_or_cached(f"kept-{key}.json", cache_dir, "kept", lambda: calibrate(model, tokenizer),
                              "kept inputs", {"fingerprint": key, "per_input": KEPT},
                              lambda v: fits_kept(model, v))
    return {k: list(v) for k, v in kept.items()}


def calibrated(key: str, cache_dir: Path, model: nn.Module) -> bool:
    """Whether the kept inputs and the kept key pairs of calibration key `key` are shipped or cached, and fit
    `model`."""
    checks = (("kept", f"kept-{key}.json", lambda v: fits_kept(model, v)),
              ("pairs", f"keypairs-{key}.json", lambda v: fits_pairs(model, v)))
    return all(_found(SHIPPED / n, f, ok) is not None or _found(cache_dir / n, f, ok) is not None
               for f, n, ok in checks)


def fits_kept(model: nn.Module, kept: dict) -> bool:
    """Whether a kept-inputs set names exactly `model`'s linear layers, each dim inside its inputs. The
    calibration key (vocabulary, family, hidden size, layers, norms) does not tell apart models that
    differ in other sizes alone: a set calibrated on one must not be read for another."""
    ins = {n: m.in_features for n, m in model.named_modules() if _linear(m)}
    return set(kept) == set(ins) and all(all(0 <= d < ins[n] for d in v) for n, v in kept.items())


def fits_pairs(model: nn.Module, pairs: list) -> bool:
    """Whether kept key pairs have `model`'s layers and KV heads, each pair inside half a head."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    half = (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads) // 2
    layers = getattr(model.get_decoder(), "layers", [])
    return pairs == [] or (len(pairs) == len(layers) and all(len(p) == kv and all(0 <= i < half for i in p)
                                                              for p in pairs))


def _found(path: Path, field: str, ok):
    """`field` of the calibration file at `path` where it exists and passes `ok`, else None."""
    if not path.exists():
        return None
    value = json.loads(path.read_text())[field]
    if ok(value):
        return value
    log.warning("int8 arithmetic: %s was calibrated for another model of this fingerprint; calibrating again", path)
    return None


def _shipped_or_cached(name: str, cache_dir: Path, field: str, compute, what: str, header: dict, ok):
    """`field` of the shipped or cached file `name` where it fits the model (`ok`); else compute() now,
    written (with `header`) into cache_dir by an atomic rename."""
    for path in (SHIPPED / name, cache_dir / name):
        value = _found(path, field, ok)
        if value is not None:
            return value
    value = compute()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f"{name}.tmp"
    tmp.write_text(json.dumps({**header, field: value}, sort_keys=True))
    tmp.replace(cache_dir / name)
    log.info("int8 arithmetic: %s calibrated (%d layers) into %s", what, len(value), cache_dir / name)
    return value


def calibrate(model: nn.Module, tokenizer, k: int = KEPT) -> dict[str, list[int]]:
    """The k largest-|x| input dims of every nn.Linear over the calibration prompts, ascending."""
    peaks: dict[str, torch.Tensor] = {}

    def hook(name):
        def pre(_module, args):
            x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
            peaks[name] = torch.maximum(peaks[name], x) if name in peaks else x
        return pre

    _run_prompts(model, tokenizer, [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
                                    if _linear(m)])
    return {n: sorted(torch.topk(p, min(k, p.numel())).indices.tolist()) for n, p in sorted(peaks.items())}


def _linear(m) -> bool:
    """A linear layer: float (before the swap) or on the exact kernels (a GGUF file read as it is)."""
    from .qlinear import QLinear

    return isinstance(m, nn.Linear) or (isinstance(m, QLinear) and m.arithmetic == "exact")


def _run_prompts(model: nn.Module, tokenizer, handles: list) -> None:
    """The calibration prompts through `model` (float32 before its linears are swapped, or on the exact
    kernels), then the hooks off."""
    try:
        with torch.inference_mode():
            for text in _prompts():
                model(torch.tensor([calibration_ids(tokenizer, text)], device=model.device))
    finally:
        for h in handles:
            h.remove()


def calibration_ids(tokenizer, text: str) -> list[int]:
    """A calibration prompt's ids: a chat first turn where the tokenizer has a chat template, else (a base
    model's file: llama.cpp's converter writes none where the checkpoint has none) the text as it is."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer(text)["input_ids"]
    return list(ids)[:MAX_TOKENS]


# ---- the int8 keys' kept pair (csrc/ikeys.h) ----------------------------------------------------------
# A model's keys peak in a few dims, and rotary embedding turns each dim i with i + head_dim / 2 as a
# pair, so per KV head one pair is kept in float32: the one whose norm (which a rotation keeps, so the
# choice holds at every position) peaks highest in the calibration prompts' keys before rotary: k_proj's
# outputs, or k_norm's where a model norms each key head first (Qwen3: the keys the cache stores are
# rotary(k_norm(k_proj(x)))). Measured
# in torch (queries and keys quantized per block of 32 and nothing else, 20 held-out prompts x 128
# tokens, against the exact model): KL mean 0.00062 without, 0.00038 with it.

def key_pairs(model: nn.Module, tokenizer, key: str, cache_dir: Path) -> list[list[int]]:
    """Per decoder layer, per KV head: its kept pair i (dims i, i + head_dim / 2), from the shipped or
    cached `keypairs-<key>.json` (`key`: calibration_key), else calibrated now and cached."""
    return _shipped_or_cached(f"keypairs-{key}.json", cache_dir, "pairs",
                              lambda: calibrate_pairs(model, tokenizer), "kept key pairs", {"fingerprint": key},
                              lambda v: fits_pairs(model, v))


def calibrate_pairs(model: nn.Module, tokenizer) -> list[list[int]]:
    """Per layer and KV head, the pair i whose norm sqrt(k_i^2 + k_(i+D/2)^2) peaks highest over the
    calibration prompts' tokens (the first such i on a tie); [] for a model without llama's layout
    (layers with self_attn.k_proj), which the native forward does not run anyway. The keys are read
    where rotary takes them: after self_attn.k_norm where there is one (Qwen3), else k_proj's output."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = getattr(model.get_decoder(), "layers", None)
    if not layers or not all(_linear(getattr(getattr(x, "self_attn", None), "k_proj", None)) for x in layers):
        return []
    peaks: list[torch.Tensor | None] = [None] * len(layers)

    def hook(i):
        def post(_module, _args, out):
            k = out.detach().float().reshape(-1, kv, D)  # [T, Hkv, D]
            norm = torch.sqrt(k[..., : D // 2] ** 2 + k[..., D // 2:] ** 2).amax(0)  # [Hkv, D / 2]
            peaks[i] = norm if peaks[i] is None else torch.maximum(peaks[i], norm)
        return post

    _run_prompts(model, tokenizer, [_pre_rotary_keys(layer.self_attn).register_forward_hook(hook(i))
                                    for i, layer in enumerate(layers)])
    return [p.argmax(-1).tolist() for p in peaks]


def _pre_rotary_keys(attn: nn.Module) -> nn.Module:
    """The module whose output is the keys rotary turns: k_norm where the attention has one (its output
    [..., Hkv, D]), else k_proj ([..., Hkv * D]); the same keys either way reshape to [T, Hkv, D]."""
    norm = getattr(attn, "k_norm", None)
    return norm if isinstance(norm, nn.Module) else attn.k_proj


def attach_key_pairs(model: nn.Module, pairs: list[list[int]]) -> None:
    """Each layer's pairs onto its k_proj (`key_pair`, [Hkv] int32), where the native forward reads them."""
    for layer, p in zip(model.get_decoder().layers, pairs):
        layer.self_attn.k_proj.key_pair = torch.tensor(p, dtype=torch.int32)


def _prompts() -> list[str]:
    from ....core.datasets import prompt_file

    last: dict[str, str] = {}
    for line in prompt_file("spec_bench").read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            last[q["category"]] = q["turns"][0]
    return list(last.values())[:CALIBRATION_PROMPTS]
