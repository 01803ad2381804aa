"""Tiny random checkpoints of three model families, each carrying its family's real chat template
(tests/services/openai/templates/, copied from llama.cpp) in a tokenizer with that family's special
tokens: the bundled vocabulary with the family's control tokens added, as its own tokenizer has them
(Llama 3.1's `<|python_tag|>` and Mistral's `[TOOL_CALLS]` special, Qwen2.5's `<tool_call>` an added
token that is not). Random weights: what such a model writes is noise, held by the grammars."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"


@dataclass(frozen=True)
class Family:
    fmt: str  # the tool-call format its template teaches (toolparse.py)
    template: str  # a file of TEMPLATES
    arch: str  # transformers' model class prefix
    specials: tuple[str, ...] = ()  # added as special (control) tokens
    added: tuple[str, ...] = ()  # added as plain tokens
    bos: str | None = None
    eos: str = "<|im_end|>"
    marker: str = ""  # the token that opens a call


FAMILIES = {
    "llama3_json": Family("llama3_json", "meta-llama-Llama-3.1-8B-Instruct.jinja", "Llama",
                          ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                           "<|eom_id|>", "<|python_tag|>"), bos="<|begin_of_text|>", eos="<|eot_id|>",
                          marker="<|python_tag|>"),
    "mistral": Family("mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "Mistral",
                      ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                       "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), bos="<s>", eos="</s>", marker="[TOOL_CALLS]"),
    "hermes": Family("hermes", "Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen2", added=("<tool_call>", "</tool_call>"),
                     marker="<tool_call>"),
}


def family_tokenizer(fmt: str):
    """The bundled tokenizer with family `fmt`'s tokens, bos / eos and chat template."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from trserve.engine.model.loader import builtin_model_dir

    family = FAMILIES[fmt]
    tok = AutoTokenizer.from_pretrained(builtin_model_dir())
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in family.specials], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    if family.bos:
        tok.bos_token = family.bos
    tok.eos_token = family.eos
    tok.chat_template = (TEMPLATES / family.template).read_text()
    return tok


def tiny_family(folder: Path, fmt: str, seed: int = 0) -> Path:
    """A random 2-layer checkpoint (hidden 128, float32) of family `fmt` with its tokenizer, in `folder`."""
    import torch
    import transformers

    family, tok = FAMILIES[fmt], family_tokenizer(fmt)
    config = getattr(transformers, family.arch + "Config")(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
        **({"sliding_window": None} if family.arch in ("Mistral", "Qwen2") else {}))
    torch.manual_seed(seed)
    model = getattr(transformers, family.arch + "ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.6 if p.dim() == 1 else 0.08) + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
