"""`trserve bench --profile`: where a decoding step's time goes, per forward kind.

For each forward kind this host runs (`transformers`: the eager modules; `native`: the one-call
forward of engine/model/native.py), on the kernels `auto` picks here: the cost of one forward per
width (1, 2, 4, 8, 16 new tokens over 512 cached ones, through the runner the decoders use), then
a few prompts decoded serially in `ar` and `tr` mode with the time inside the runner's forwards
and the time outside them (drafting, acceptance, recycling, sampling, streaming) per step. For the
native forward, also its cost by phase per width (bench/phases.py: q/k/v, attention, MLP,
LM head, ...), so where a verified row's cost goes is read off one table. Written as JSON
(bench-results/profile.json) and a table, with the host's CPU and ISA flags.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch

from .host import host_facts
from .report import write_report
from .runner import WARMUP, select_questions

log = logging.getLogger("trserve.bench")


@dataclass(frozen=True)
class ProfileConfig:
    prompts: str
    n_prompts: int = 6
    max_new_tokens: int = 64
    forwards: tuple[str, ...] = ("transformers", "native")
    widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    kv: int = 512
    kernels: str = "auto"
    arithmetic: str = "auto"  # the compressed kernels' arithmetic (ModelConfig)
    threads: int | None = None
    json_path: str = "bench-results/profile.json"
    model: str | None = None  # `--model`: the model measured (None: the bundled one)

    def __post_init__(self) -> None:
        if not self.forwards or set(self.forwards) - {"transformers", "native"}:
            raise ValueError(f"forwards must be a subset of transformers, native; got {list(self.forwards)}")
        if self.n_prompts < 1 or self.max_new_tokens < 1 or self.kv < 1:
            raise ValueError("n_prompts, max_new_tokens and kv must be >= 1")


def _profile_one(loaded, config: ProfileConfig, questions: list[dict]) -> dict:
    from ..engine import Decoder, DecoderConfig
    from ..engine.tuning.calibrate import measure

    cost = measure(loaded.model, widths=config.widths, kv_lens=(config.kv,), reps=3, passes=2, native=loaded.native)
    out = {"forward": loaded.forward, "kernels": loaded.kernels, "isa": loaded.isa, "arithmetic": loaded.arithmetic,
           "width_ms": {str(w): round(1000 * s, 2) for w, s in zip(cost.widths, cost.seconds[0])}, "modes": {}}
    if loaded.forward == "native" and loaded.isa:
        from .phases import forward_phases

        out["phases_ms"] = forward_phases(loaded, config.widths, config.kv)
    decoder = Decoder(DecoderConfig(model=_model_config(config, loaded.forward)), loaded=loaded)
    engine = decoder.engine
    runner = engine.runner
    for mode in ("ar", "tr"):
        matrix = decoder.new_matrix() if mode == "tr" else None
        _generate(decoder, engine, WARMUP, 32, mode, matrix)
        runner.step_s, runner.steps = 0.0, 0
        steps = tokens = cached = 0
        decode_s = prefill_s = 0.0
        for q in questions:
            r = _generate(decoder, engine, [{"role": "user", "content": q["turns"][0]}], config.max_new_tokens, mode,
                          matrix)
            steps += r.stats.steps
            tokens += r.stats.generated_tokens
            decode_s += r.stats.decode_s
            prefill_s += r.stats.prefill_s
            cached += r.stats.cached_tokens
        forward_s = runner.step_s
        out["modes"][mode] = {
            "steps": steps, "tokens": tokens, "tokens_per_s": round(tokens / (prefill_s + decode_s), 2),
            "forward_ms_per_step": round(1000 * forward_s / max(steps, 1), 2),
            "other_ms_per_step": round(1000 * (decode_s - forward_s) / max(steps, 1), 2),
            "prefill_ms_per_prompt": round(1000 * prefill_s / len(questions), 1), "cached_prompt_tokens": cached,
            "tokens_per_step": round(tokens / max(steps, 1), 2)}
    return out


def _generate(decoder, engine, messages: list[dict], max_new_tokens: int, mode: str, matrix):
    """One request of `mode` through `engine`, as tenant "profile-<mode>": the modes share the engine, and
    its prefix cache must not hand `tr` the prompts `ar` prefilled."""
    from ..engine import GenerationRequest

    request = GenerationRequest(messages=messages, max_new_tokens=max_new_tokens, mode=mode)
    return engine.generate(decoder.prepare(request), matrix=matrix, tenant=f"profile-{mode}")


def _model_config(config: ProfileConfig, forward: str):
    from ..engine import ModelConfig

    return ModelConfig(**({"source": config.model} if config.model else {}), kernels=config.kernels,
                       threads=config.threads, forward=forward, arithmetic=config.arithmetic)


def run_profile(config: ProfileConfig) -> dict:
    from ..engine import load_model

    if config.threads:
        torch.set_num_threads(config.threads)
    questions = select_questions(config.prompts, 1)[: config.n_prompts]
    report = {"config": asdict(config), "environment": {
        **host_facts(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, "runs": []}
    loaded = None
    for forward in config.forwards:
        loaded = load_model(_model_config(config, forward))
        if loaded.forward != forward:
            log.warning("forward %s does not apply to this model here; skipped", forward)
            continue
        report["runs"].append(_profile_one(loaded, config, questions))
    write_report(config.json_path, report, format_profile(report))
    return report


def format_profile(report: dict) -> str:
    env = report["environment"]
    lines = [f"per-step profile ({env['threads']} threads; {env['cpu']}; {' '.join(env['isa_flags'])})", ""]
    widths = list(report["runs"][0]["width_ms"]) if report["runs"] else []
    lines.append(f"{'forward':<14}{'kernels':<22}" + "".join(f"{'w=' + w:>8}" for w in widths) + "   (ms per forward)")
    for r in report["runs"]:
        kern = f"{r['kernels']}{'-' + r['isa'] if r['isa'] else ''}"
        lines.append(f"{r['forward']:<14}{kern:<22}" + "".join(f"{r['width_ms'][w]:>8.1f}" for w in widths))
    lines += ["", f"{'forward':<14}{'mode':<6}{'tok/s':>8}{'tok/step':>10}{'fwd ms':>9}{'other ms':>10}"
              f"{'prefill ms':>12}"]
    for r in report["runs"]:
        for mode, m in r["modes"].items():
            lines.append(f"{r['forward']:<14}{mode:<6}{m['tokens_per_s']:>8.1f}{m['tokens_per_step']:>10.2f}"
                         f"{m['forward_ms_per_step']:>9.2f}{m['other_ms_per_step']:>10.2f}"
                         f"{m['prefill_ms_per_prompt']:>12.1f}")
    for r in report["runs"]:
        if r.get("phases_ms"):
            from .phases import format_phases

            lines += ["", f"by phase ({r['kernels']}-{r['isa']}, {r['arithmetic']}, "
                          f"{report['config']['kv']} cached tokens):", *format_phases(r["phases_ms"])]
    return "\n".join(lines)
