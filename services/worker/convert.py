"""Protobuf <-> the front door for the Generate API (the gRPC edge of services/worker/front.py).

A GenerateRequest becomes an `Ask` (checks.py): the wire's own rules only (one input, known enums, how
logprobs and structured output are spelled), everything else as given. The server's limits (sizes, caps,
tenant ids, builtin trees only) are checked once by the front door (checks.py:check_call), for gRPC and
HTTP alike, and the request's own rules by the engine's GenerationRequest. Results become protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...core.errors import InvalidArgument
from ...engine.request.chat import ChatOptions, chat_options_from_json
from ...engine.request.history import chat_turns, reads_tool_calls
from ...engine.request.tools import tool_functions, tools_from_json
from ...engine.results import GenerationResult, GenerationStats, StepChunk
from ...engine.runtime import RuntimeInfo
from ...engine.tr.grammar import StructuredOutput
from ...engine.tr.sampling import SamplingParams
from ..openai.toolchoice import AutoTools, ToolReading, apply_tool_choice, kept_markers
from ..openai.toolparse import marker_tokens, resolve_parser
from .checks import Ask, GenerateCall
from .config import Limits, WorkerConfig
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
TOOL_CHOICES = {pb.TOOL_CHOICE_UNSPECIFIED: None, pb.TOOL_CHOICE_AUTO: "auto", pb.TOOL_CHOICE_NONE: "none",
                pb.TOOL_CHOICE_REQUIRED: "required"}


@dataclass(frozen=True)
class ServedTools:
    """The tool-call format this worker's template writes calls in (ModelInfo.tool_call_parser; None: none)
    and its markers' ids as tokens of their own (toolparse.py:marker_tokens): fixed per worker."""

    fmt: str | None = None
    markers: tuple[int, ...] = ()
    fold: bool = False  # the template that renders tools reads no tool_calls (toolchoice.py)


def ask_from_pb(req: pb.GenerateRequest, served: ServedTools = ServedTools()) -> tuple[Ask, ToolReading | None]:
    """The request's Ask, and how its reply is read for tool calls (None: it is not)."""
    text, messages, token_ids, chat, tools = _input_from_pb(req)
    if req.mode not in MODES:
        raise InvalidArgument(f"mode {req.mode} is unknown; use DECODING_MODE_TR (default) or DECODING_MODE_AR")
    options = dict(
        prompt=text, messages=messages, input_ids=token_ids,
        stop_strings=tuple(req.stop_sequences), stop_token_ids=tuple(req.stop_token_ids), mode=MODES[req.mode],
        tree=req.tree or None, sampling=_sampling_from_pb(req.sampling), logprobs=_logprobs_from_pb(req),
        ignore_eos=req.ignore_eos, prompt_logprobs=int(req.top_logprobs) if req.prompt_logprobs else None,
        logit_bias=tuple(sorted(req.logit_bias.items())), min_tokens=int(req.min_tokens),
        repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else 1.0,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        structured=_structured_from_pb(req), chat=chat, tools=None,
    )
    reading = _tool_choice(req, options, tools, served)
    return Ask(options, tenant=req.tenant or None, domain=req.domain if req.HasField("domain") else None,
               max_new_tokens=req.max_new_tokens if req.HasField("max_new_tokens") else None,
               return_token_ids=req.return_token_ids), reading


def _tool_choice(req, opts: dict, tools: tuple[dict, ...] | None, served: ServedTools) -> ToolReading | None:
    """ChatMessages.tool_choice onto the engine request's fields `opts` (toolchoice.py, as HTTP's): with
    UNSPECIFIED, "auto" where the template has a format and the caller gives no structured_output (else its
    tools are only described, and replies read unheld where there is a format)."""
    m = req.messages if req.WhichOneof("input") == "messages" else None
    if m is None or m.tool_choice not in TOOL_CHOICES:
        if m is not None:
            raise InvalidArgument(f"tool_choice {m.tool_choice} is unknown; use TOOL_CHOICE_AUTO, _NONE or _REQUIRED")
        return None
    choice, function = TOOL_CHOICES[m.tool_choice], m.tool_choice_function or None
    parallel = m.parallel_tool_calls if m.HasField("parallel_tool_calls") else True
    if tools is None:
        if choice not in (None, "none") or function is not None:
            raise InvalidArgument("tool_choice and tool_choice_function need tools (ChatMessages.tools)")
        return None
    functions = tool_functions(list(tools))
    if choice is None and function is None and (served.fmt is None or opts["structured"] is not None):
        opts["tools"] = tools  # described by the template; calls read as written, no grammar of ours
        opts["kept_special"] = kept_markers(served.fmt, served.markers)
        return ToolReading(auto=AutoTools(served.fmt, tuple(functions), parallel)) if served.fmt else None
    if function is not None and choice is None:
        choice = "required"
    return apply_tool_choice(opts, functions, "auto" if choice is None else choice, served.fmt, parallel,
                             served.markers, function, served.fold)


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


def _input_from_pb(req) -> tuple[str | None, list[dict] | None, list[int] | None, ChatOptions | None,
                                 tuple[dict, ...] | None]:
    """(text, messages, token_ids, chat options, tools) of a GenerateRequest or TokenizeRequest; exactly one
    of the first three is not None; the chat options and tools only with messages, None where all are their
    defaults / where there are none."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("no prompt: set one of text, messages or token_ids")
    if kind == "text":
        return req.text, None, None, None, None
    if kind == "messages":
        m = req.messages
        chat = chat_options_from_json(m.chat_template_kwargs, m.add_generation_prompt if m.HasField(
            "add_generation_prompt") else True, m.continue_final_message)
        return None, chat_turns([_turn_from_pb(t) for t in m.messages]), None, chat, tools_from_json(m.tools)
    return None, None, list(req.token_ids.ids), None, None


def _turn_from_pb(t: pb.ChatMessage) -> dict:
    """A ChatMessage as OpenAI's message (history.py checks it): its earlier calls and tool_call_id."""
    turn: dict = {"role": t.role, "content": t.content}
    if t.tool_calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                              for c in t.tool_calls]
    for name in ("tool_call_id", "name"):
        if getattr(t, name):
            turn[name] = getattr(t, name)
    return turn


def _sampling_from_pb(s: pb.SamplingParams) -> SamplingParams | None:
    """Engine sampling params (validated there), or None for greedy (temperature 0).

    The API's 0 means "off" for top_p, top_k and min_p (proto3 defaults); the engine's "off" top_p is 1.
    """
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0, min_p=s.min_p,
                            seed=s.seed if s.HasField("seed") else None)
    return None if params.greedy else params


def tokenize_input_from_pb(req: pb.TokenizeRequest, served: ServedTools = ServedTools()
                           ) -> tuple[str | None, list[dict] | None, ChatOptions | None, tuple[dict, ...] | None]:
    """(text, messages, chat options, tools) as Generate's prompt has them (tool_choice applied)."""
    text, messages, _, chat, tools = _input_from_pb(req)
    opts = {"messages": messages, "structured": None, "tools": None}
    _tool_choice(req, opts, tools, served)
    return text, opts["messages"], chat, opts["tools"]


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


def model_info_to_pb(decoder: TargetModel, limits: Limits, name: str,
                     parsers: tuple[str, str] = ("", "")) -> pb.ModelInfoResponse:
    """`parsers`: (tool-call format, reasoning parser) as served_parsers gives them."""
    d, info = decoder, RuntimeInfo.of(decoder)
    return pb.ModelInfoResponse(
        model=name, fingerprint=d.fingerprint, vocab_size=d.vocab_size,
        max_context=d.max_context, default_tree=info.tree, default_tree_nodes=d.default_tree.n, k=d.config.k,
        max_new_tokens_cap=limits.max_new_tokens_cap, default_max_new_tokens=limits.default_max_new_tokens,
        max_prompt_tokens=limits.max_prompt_tokens, device=info.device, kernels=info.kernels,
        attention=info.attention, threads=info.threads, kernel_isa=info.isa,
        arithmetic=info.arithmetic, quantize=info.quantize, tool_call_parser=parsers[0],
        reasoning_parser=parsers[1],
    )


def read_tool_calls(reading: ToolReading | None, result: GenerationResult, reply) -> None:
    """Into `reply` (a GenerateResponse or the last GenerateStreamResponse): the calls the result's text
    makes as `reading` (ask_from_pb's) reads them, and why an opened one is not a call; nothing without."""
    parsed = reading.read(result.text, result.finish_reason) if reading is not None else None
    if parsed is None:
        return
    reply.tool_calls.extend(pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments_json=c["function"]["arguments"])
                            for c in parsed.calls)
    reply.tool_call_error = parsed.error or ""


def served_parsers(config: WorkerConfig, decoder: TargetModel) -> tuple[str, str]:
    """(the tool-call format tool_choice "auto" reads: --tool-call-parser, "auto" resolved from the chat
    template that renders tools; the reasoning parser), "" for none."""
    return (resolve_parser(config.tool_call_parser, decoder.prompts.tool_template) or "",
            config.reasoning_parser or "")


def served_tools(fmt: str, decoder: TargetModel) -> ServedTools:
    """`fmt` (served_parsers' format, "" for none) with its markers in the served tokenizer."""
    return ServedTools(fmt or None, marker_tokens(decoder.tokenizer, fmt or None),
                       not reads_tool_calls(decoder.prompts.tool_template))
