"""How close the int8 arithmetic (and bfloat16) stays to the exact model: `trserve bench --fidelity`.

Measured as llama.cpp's `llama-perplexity --kl-divergence` does: the exact model's own greedy
continuation (128 tokens) of held-out prompts, then every arithmetic teacher-forced over it; per
position the top-1 agreement with the exact token and KL(exact || other) of the next-token laws.

- int8: the native forward on the compressed kernels' int8 arithmetic (csrc/qlinear_i8.c).
- bfloat16: transformers' stock model in bfloat16 (what the CUDA path and GPU servers run).
- a checkpoint `--model` (a transformers directory): the exact model is its float weights (`--quantize
  none`), and each format it can be quantized to at load (engine/model/checkpoint.py) is measured in
  both arithmetics (`q8_0 exact`, `q8_0 int8`, ...; `--quantize` names one, auto all): the table the
  default format was chosen by.
- identical_128: the share of prompts whose first 128 greedy tokens equal the exact model's. For the
  int8 and exact native forwards a token's logits are the same bits teacher-forced or decoded one by
  one (csrc/forward.c), so this is the share of prompts with top-1 agreement at all 128 positions; for
  bfloat16 it is counted the same way (teacher-forced), a close estimate of its free-running share.

logits_sha256: a digest of the exact and int8 teacher-forced logits (float32 bytes, prompts in order):
both promise the same bits on every build and host, so two hosts that print the same digests agree
bit for bit on these 5,504 positions (bfloat16 runs torch's own kernels, which promise no such thing).

Prompts: spec_bench, per category the questions after the bench's first three (the tuner takes the
last one): up to 7 per category, 43 prompts, 5,504 positions.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .host import host_facts

log = logging.getLogger("trserve.bench")


@dataclass(frozen=True)
class FidelityConfig:
    prompts: str  # a spec_bench-format .jsonl
    new_tokens: int = 128  # the exact model's greedy continuation, per prompt
    per_category: int = 7  # held-out questions per category at most
    skip_first: int = 3  # the bench's questions (its --per-category default of the published tables)
    threads: int | None = None
    bfloat16: bool = True  # also measure transformers' stock model in bfloat16
    json_path: str = "bench-results/fidelity.json"
    model: str | None = None  # `--model` (None: the bundled model)
    quantize: str = "auto"  # a checkpoint `model`: the format measured (auto: every one)

    def __post_init__(self) -> None:
        if self.new_tokens < 1 or self.per_category < 1 or self.skip_first < 0:
            raise ValueError("new_tokens and per_category must be >= 1, skip_first >= 0")


def held_out(path: str, per_category: int, skip_first: int) -> list[str]:
    """First turns, per category the questions after the first `skip_first`, never the last one."""
    by_cat: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            by_cat.setdefault(q.get("category", ""), []).append(q["turns"][0])
    return [t for qs in by_cat.values() for t in qs[skip_first:-1][:per_category]]


def teacher_forced(model, ids: list[int], n_prompt: int) -> torch.Tensor:
    """Logits [len(ids) - n_prompt, V] (float32) predicting ids[n_prompt:], one prefill of the whole sequence
    through the runner the decoders use (the native forward where the model takes it)."""
    from ..engine.model.runner import ModelRunner

    dtype = next(model.parameters()).dtype
    with torch.inference_mode():
        runner = ModelRunner(model, 1, dtype)
        row = runner.kv.open_row()
        need = torch.arange(n_prompt - 1, len(ids) - 1, device=model.device)
        return runner.prefill(row, torch.tensor(ids, device=model.device), need).float()


def compare(exact: torch.Tensor, other: torch.Tensor, tokens: torch.Tensor) -> dict:
    """exact, other: logits [n, V]; tokens [n] the exact greedy tokens -> per-position agreement and KL."""
    le, lo = torch.log_softmax(exact, -1), torch.log_softmax(other, -1)
    kl = (le.exp() * (le - lo)).sum(-1).clamp_min(0)  # [n]
    return {"agree": (other.argmax(-1) == tokens), "kl": kl}


def summarise(parts: list[dict]) -> dict:
    agree = torch.cat([p["agree"] for p in parts]).float()
    kl = torch.cat([p["kl"] for p in parts]).double()
    return {"positions": int(agree.numel()), "top1_agreement": round(float(agree.mean()), 4),
            "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)),
            "identical_128": round(sum(bool(p["agree"].all()) for p in parts) / len(parts), 4)}


def run_fidelity(config: FidelityConfig) -> dict:
    from ..engine import Decoder, DecoderConfig, GenerationRequest, ModelConfig
    from ..engine.model.loader import load_model

    if config.threads:
        torch.set_num_threads(config.threads)
    # the reference named, never the default: the default became int8 (`auto`), and this compared int8 to itself
    source = {"source": config.model} if config.model else {}
    if config.model and Path(config.model).is_dir():  # a checkpoint: its float weights, and its formats
        exact = Decoder(DecoderConfig(model=ModelConfig(**source, threads=config.threads, quantize="none")))
        others = _formats(config)
    else:
        exact = Decoder(DecoderConfig(model=ModelConfig(**source, threads=config.threads, arithmetic="exact")))
        others = {"int8": load_model(ModelConfig(**source, threads=config.threads, arithmetic="int8",
                                                 kernels="compressed"))}
        if exact.loaded.arithmetic != "exact" or others["int8"].arithmetic != "int8":
            raise RuntimeError(f"fidelity needs the exact and int8 arithmetics; got {exact.loaded.arithmetic} and "
                               f"{others['int8'].arithmetic}")
    if config.bfloat16:
        others["bfloat16"] = load_model(ModelConfig(**source, threads=config.threads, kernels="stock", dtype="bfloat16",
                                                    device="cpu"))
    parts: dict[str, list[dict]] = {name: [] for name in others}
    # the logits' bits, for comparing hosts: exact and int8 promise the same bits on every build and host
    digests = {"exact": hashlib.sha256(), **{n: hashlib.sha256() for n in others if n != "bfloat16"}}
    texts = held_out(config.prompts, config.per_category, config.skip_first)
    for i, text in enumerate(texts):
        prompt = exact.prompts.chat_ids([{"role": "user", "content": text}])
        out = exact.generate(GenerationRequest(input_ids=prompt, max_new_tokens=config.new_tokens, ignore_eos=True,
                                               mode="ar"))
        ids, tokens = prompt + out.ids, torch.tensor(out.ids)
        ref = teacher_forced(exact.loaded.model, ids, len(prompt))
        assert torch.equal(ref.argmax(-1), tokens), "the exact native forward: teacher-forced != decoded"
        digests["exact"].update(ref.numpy().tobytes())
        for name, loaded in others.items():
            logits = teacher_forced(loaded.model, ids, len(prompt))
            if name in digests:
                digests[name].update(logits.numpy().tobytes())
            parts[name].append(compare(ref, logits, tokens))
        log.info("fidelity: prompt %d/%d", i + 1, len(texts))
    report = {"config": config.__dict__, "host": host_facts(), "prompts": len(texts),
              "modes": {name: summarise(p) for name, p in parts.items()},
              "logits_sha256": {name: h.hexdigest() for name, h in digests.items()}}
    Path(config.json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(config.json_path).write_text(json.dumps(report, indent=1))
    print(table(report))
    return report


def _formats(config: FidelityConfig) -> dict:
    """A checkpoint quantized at load to each format (or the one named), in both arithmetics."""
    from ..engine.model.choices import QUANTIZE
    from ..engine.model.loader import ModelConfig, load_model

    fmts = [f for f in QUANTIZE if f != "none"] if config.quantize == "auto" else [config.quantize]
    out = {}
    for fmt in fmts:
        for arith in ("exact", "int8"):
            loaded = load_model(ModelConfig(source=config.model, threads=config.threads, quantize=fmt,
                                            arithmetic=arith, kernels="compressed"))
            if loaded.quantize != fmt or loaded.arithmetic != arith:
                raise RuntimeError(f"{config.model} did not load as {fmt} {arith}: {loaded.quantize} {loaded.arithmetic}")
            out[f"{fmt} {arith}"] = loaded
    return out


def table(report: dict) -> str:
    lines = [f"fidelity to the exact model: {report['prompts']} held-out prompts, teacher-forced over its greedy "
             f"continuations ({report['host']['cpu']}; {' '.join(report['host']['isa_flags'])})",
             f"{'mode':<12}{'positions':>10}{'top-1 agree':>13}{'KL mean':>11}{'KL p99':>10}{'same 128':>10}"]
    for name, m in report["modes"].items():
        lines.append(f"{name:<12}{m['positions']:>10}{100 * m['top1_agreement']:>12.2f}%{m['kl_mean']:>11.5f}"
                     f"{m['kl_p99']:>10.4f}{100 * m['identical_128']:>9.1f}%")
    lines += [f"logits sha256 ({name}): {h}" for name, h in report.get("logits_sha256", {}).items()]
    return "\n".join(lines)
