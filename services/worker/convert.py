"""Protobuf <-> engine conversions for the Generate API, with up-front request validation.

The server's limits (sizes, caps, builtin trees only) are checked here and the request's own rules
by the engine's GenerationRequest as it is built, so a bad request is refused before it takes a
place in the decoding queue. Errors are InvalidArgument / NotFound with a message that says how to
fix the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...core.errors import InvalidArgument, NotFound
from ...core.tenants import validate_tenant_id
from ...engine.request.request import GenerationRequest
from ...engine.results import GenerationResult, GenerationStats, StepChunk
from ...engine.runtime import RuntimeInfo
from ...engine.tr.grammar import StructuredOutput
from ...engine.tr.sampling import SamplingParams
from ...engine.tr.tree import builtin_trees
from .config import MESSAGE_OVERHEAD_CHARS, Limits
from ...v1 import generate_pb2 as pb

if TYPE_CHECKING:
    from ...engine.target import TargetModel

FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP_SEQUENCE,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "time_limit": pb.FINISH_REASON_TIME_LIMIT,
    "grammar": pb.FINISH_REASON_GRAMMAR,
}
MODES = {pb.DECODING_MODE_UNSPECIFIED: "tr", pb.DECODING_MODE_TR: "tr", pb.DECODING_MODE_AR: "ar"}


@dataclass(frozen=True)
class GenerateCall:
    """A validated GenerateRequest: who asks (tenant, domain), what the engine runs, what to return."""

    tenant: str
    domain: str | None
    request: GenerationRequest  # validated by the engine type itself
    return_token_ids: bool


def generate_call_from_pb(req: pb.GenerateRequest, limits: Limits, default_tenant: str) -> GenerateCall:
    tenant = validate_tenant_id(req.tenant or default_tenant)
    domain = validate_tenant_id(req.domain, "domain") if req.HasField("domain") else None
    text, messages, token_ids = _input_from_pb(req, limits)
    if req.mode not in MODES:
        raise InvalidArgument(f"mode {req.mode} is unknown; use DECODING_MODE_TR (default) or DECODING_MODE_AR")
    _check_stops(req, limits)
    request = GenerationRequest(
        prompt=text, messages=messages, input_ids=token_ids, max_new_tokens=_max_new_tokens(req, limits),
        stop_strings=tuple(req.stop_sequences), stop_token_ids=tuple(req.stop_token_ids), mode=MODES[req.mode],
        tree=_tree_name(req.tree), sampling=_sampling_from_pb(req.sampling), logprobs=_logprobs_from_pb(req),
        ignore_eos=req.ignore_eos, prompt_logprobs=int(req.top_logprobs) if req.prompt_logprobs else None,
        logit_bias=tuple(sorted(req.logit_bias.items())), min_tokens=int(req.min_tokens),
        repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else 1.0,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        structured=_structured_from_pb(req),
    )
    return GenerateCall(tenant=tenant, domain=domain, request=request, return_token_ids=req.return_token_ids)


def _structured_from_pb(req: pb.GenerateRequest) -> StructuredOutput | None:
    """The request's structured output (engine/tr/grammar.py), None where it has none."""
    if not req.HasField("structured_output"):
        return None
    so = req.structured_output
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("structured_output is set but names no kind: set one of json_schema, json_object, "
                              "regex, choice, grammar")
    if kind == "json_object":
        if not so.json_object:
            raise InvalidArgument("structured_output.json_object must be true where set")
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(so.choice.options))
    return StructuredOutput(kind, getattr(so, kind))


def _logprobs_from_pb(req: pb.GenerateRequest) -> int | None:
    if req.top_logprobs > 20:
        raise InvalidArgument(f"top_logprobs must be in 0..20, got {req.top_logprobs}")
    if not req.logprobs:
        if req.top_logprobs and not req.prompt_logprobs:
            raise InvalidArgument("top_logprobs needs logprobs or prompt_logprobs = true")
        return None
    return int(req.top_logprobs)


def logprobs_to_pb(logprobs) -> list[pb.TokenLogprob]:
    """engine TokenLogprobs -> protobuf (empty when none were asked)."""
    return [pb.TokenLogprob(token_id=lp.token, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in lp.top]) for lp in logprobs or ()]


def _check_stops(req: pb.GenerateRequest, limits: Limits) -> None:
    if len(req.stop_sequences) > limits.max_stop_sequences:
        raise InvalidArgument(f"{len(req.stop_sequences)} stop sequences given; at most {limits.max_stop_sequences}")
    longest = max((len(s) for s in req.stop_sequences), default=0)
    if longest > limits.max_stop_sequence_chars:
        raise InvalidArgument(f"a stop sequence has {longest} characters; the limit is "
                              f"{limits.max_stop_sequence_chars}: shorten it")
    if len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidArgument(f"{len(req.stop_token_ids)} stop token ids given; at most {limits.max_stop_token_ids}")


def _tree_name(name: str) -> str | None:
    """Requests may only name builtin trees (never a server-side file path)."""
    if not name:
        return None
    if name not in builtin_trees():
        raise NotFound(f"unknown tree {name!r}: use one of {builtin_trees()} or leave it empty for the server default")
    return name


def _input_from_pb(req, limits: Limits) -> tuple[str | None, list[dict] | None, list[int] | None]:
    """(text, messages, token_ids) of a GenerateRequest or TokenizeRequest; exactly one is not None."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("no prompt: set one of text, messages or token_ids")
    if kind == "text":
        if len(req.text) > limits.max_prompt_chars:
            raise InvalidArgument(f"prompt text has {len(req.text)} characters; the limit is {limits.max_prompt_chars} "
                                  f"(and {limits.max_prompt_tokens} tokens): shorten it")
        return req.text, None, None
    if kind == "messages":
        turns = req.messages.messages
        if len(turns) > limits.max_messages:
            raise InvalidArgument(f"{len(turns)} chat messages given; at most {limits.max_messages}: "
                                  "send fewer turns")
        # content plus each turn's markup, before anything is built or tokenized
        size = sum(len(m.content) + len(m.role) + MESSAGE_OVERHEAD_CHARS for m in turns)
        if size > limits.max_prompt_chars:
            raise InvalidArgument(f"messages have {size} characters (content, plus {MESSAGE_OVERHEAD_CHARS} "
                                  f"per message); the limit is {limits.max_prompt_chars} "
                                  f"(and {limits.max_prompt_tokens} tokens): shorten them")
        msgs = [{"role": m.role, "content": m.content} for m in turns]
        return None, msgs, None
    ids = list(req.token_ids.ids)
    check_prompt_length(len(ids), limits)
    return None, None, ids


def check_prompt_length(n_tokens: int, limits: Limits) -> None:
    if n_tokens > limits.max_prompt_tokens:
        raise InvalidArgument(f"prompt has {n_tokens} tokens; this server accepts at most {limits.max_prompt_tokens}: "
                              "shorten it")


def _max_new_tokens(req: pb.GenerateRequest, limits: Limits) -> int:
    if not req.HasField("max_new_tokens"):
        return limits.default_max_new_tokens
    n = req.max_new_tokens
    if not 1 <= n <= limits.max_new_tokens_cap:
        raise InvalidArgument(f"max_new_tokens must be in [1, {limits.max_new_tokens_cap}], got {n} "
                              f"(leave it unset for the default, {limits.default_max_new_tokens})")
    return n


def _sampling_from_pb(s: pb.SamplingParams) -> SamplingParams | None:
    """Engine sampling params (validated there), or None for greedy (temperature 0).

    The API's 0 means "off" for top_p and top_k (proto3 defaults); the engine's "off" top_p is 1.
    """
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                            seed=s.seed if s.HasField("seed") else None)
    return None if params.greedy else params


def tokenize_input_from_pb(req: pb.TokenizeRequest, limits: Limits) -> tuple[str | None, list[dict] | None]:
    text, messages, _ = _input_from_pb(req, limits)
    return text, messages


def stats_to_pb(stats: GenerationStats, queue_s: float) -> pb.GenerationStats:
    out = pb.GenerationStats(
        prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens, steps=stats.steps,
        mean_accepted_tokens=stats.mat, tokens_per_second=stats.tokens_per_s,
        prefill_ms=stats.prefill_s * 1e3, decode_ms=stats.decode_s * 1e3, queue_ms=queue_s * 1e3,
        draft_mode=stats.draft_mode, tree=stats.tree, cached_prompt_tokens=stats.cached_tokens,
    )
    if stats.matrix_version is not None:
        out.matrix_version = stats.matrix_version
    if stats.matrix_epoch is not None:
        out.matrix_epoch = stats.matrix_epoch
    return out


def result_to_pb(result: GenerationResult, call: GenerateCall, queue_s: float) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        text=result.text, token_ids=result.ids if call.return_token_ids else [],
        finish_reason=FINISH_REASONS[result.finish_reason], stats=stats_to_pb(result.stats, queue_s),
        logprobs=logprobs_to_pb(result.logprobs), prompt_logprobs=logprobs_to_pb((result.prompt_logprobs or ())[1:]),
    )


def chunk_to_pb(chunk: StepChunk) -> pb.GenerateStreamResponse:
    return pb.GenerateStreamResponse(token_ids=chunk.tokens, text=chunk.text, logprobs=logprobs_to_pb(chunk.logprobs))


def final_chunk_to_pb(result: GenerationResult, text_sent: str, queue_s: float) -> pb.GenerateStreamResponse:
    """The last stream message: finish reason, stats, and any text the step deltas held back."""
    rest = result.text[len(text_sent):] if result.text.startswith(text_sent) else ""
    return pb.GenerateStreamResponse(text=rest, finish_reason=FINISH_REASONS[result.finish_reason],
                                     stats=stats_to_pb(result.stats, queue_s))


def model_info_to_pb(decoder: TargetModel, limits: Limits, name: str) -> pb.ModelInfoResponse:
    d, info = decoder, RuntimeInfo.of(decoder)
    return pb.ModelInfoResponse(
        model=name, fingerprint=d.fingerprint, vocab_size=d.vocab_size,
        max_context=d.max_context, default_tree=info.tree, default_tree_nodes=d.default_tree.n, k=d.config.k,
        max_new_tokens_cap=limits.max_new_tokens_cap, default_max_new_tokens=limits.default_max_new_tokens,
        max_prompt_tokens=limits.max_prompt_tokens, device=info.device, kernels=info.kernels,
        attention=info.attention, threads=info.threads, kernel_isa=info.isa,
        arithmetic=info.arithmetic, quantize=info.quantize,
    )
