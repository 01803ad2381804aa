"""OpenAI JSON <-> the worker's front door (services/worker/front.py): a request body becomes an `Ask`
(the engine request's fields, as the caller gave them), checked there for HTTP and gRPC alike by
`services/worker/checks.py:check_call` (limits, tenant ids, stops) and the engine's own request type,
so both APIs accept and refuse the same things with the same messages. Here only what is OpenAI's own
(its field names, types and spellings). Results become OpenAI completions, chunks and usage, with
trserve's speculation figures under a `trserve` key.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass

from ...core.errors import InvalidArgument
from ...engine.results import GenerationResult, GenerationStats
from ...engine.tr.sampling import SamplingParams
from ...engine.request.chat import ChatOptions
from ...engine.request.history import chat_turn
from ..worker.checks import Ask
from .chat import chat_options
from .errors import BadParam, ModelNotFound  # noqa: F401 - re-exported
from .options import (Vocabulary, echo_options, f32, logprobs_json, logprobs_options, rules_options,
                      structured_options)
from .toolchoice import required_calls
from .tools import AutoTools, auto_choice, tool_options
from .toolstream import AutoStream

# trserve's finish reasons -> OpenAI's: a result cut short for any reason but a stop is "length"
FINISH = {"eos": "stop", "stop": "stop", "grammar": "stop", "length": "length", "time_limit": "length", "cancelled": "length",
          "shutdown": "length"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MODES = ("tr", "ar")
MAX_CHOICES = 16  # n
# fields whose non-default values change the output in ways trserve does not do: refused, not ignored
# (every request field, and what is done with it: docs/openai.md, checked by tests/services/openai/test_convert.py)
UNSUPPORTED = {"functions": None, "function_call": None,
               "suffix": None, "best_of": 1,
               "audio": None, "prediction": None, "modalities": ["text"], "web_search_options": None,
               "verbosity": "medium",
               # vLLM's extensions (extra_body) that change the output: refused until built, never ignored
               "guided_whitespace_pattern": None,
               "length_penalty": 1.0,
               "use_beam_search": False, "allowed_token_ids": None, "bad_words": None, "logits_processors": None,
               "prompt_logprobs": None, "truncate_prompt_tokens": None, "include_stop_str_in_output": False,
               "skip_special_tokens": True, "spaces_between_special_tokens": True, "chat_template": None,
               "documents": None}


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed chat or completion request: what to ask the front door, and how to answer."""

    kind: str  # "chat" or "text"
    model: str
    ask: Ask
    stream: bool
    include_usage: bool
    n: int = 1  # choices (decoded side by side, each its own request)
    echo: str | None = None  # completions' echo=true: the prompt's text, put before each choice's
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token decoded, then dropped)
    tools: tuple[str, ...] | None = None  # the reply must call one of these tools: answered as tool_calls
    auto: AutoTools | None = None  # tool_choice "auto": the reply is read for calls (tools.py)


def parse_request(body: object, kind: str, model_id: str, tenant: str | None,
                  tool_format: str | None = None, tool_markers: tuple[int, ...] = (), tool_fold: bool = False
                  ) -> OpenAIRequest:
    """From a JSON body: `kind` "chat" (messages) or "text" (prompt). `tenant`: the caller's (authorised,
    not yet checked: the front door checks it), None for the server's default. `tool_format`: the served
    template's tool-call format (toolparse.py; None: tool_choice "auto" is refused), `tool_markers` the ids
    of its markers as tokens of their own (toolparse.py:marker_tokens), `tool_fold` whether the template
    that renders tools reads no tool_calls (toolchoice.py)."""
    if not isinstance(body, dict):
        raise BadParam("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadParam("model is required: use the id GET /v1/models lists", "model")
    if model != model_id:
        raise ModelNotFound(f"the model {model!r} does not exist here: this server serves {model_id!r}", "model")
    _check_unsupported(body)
    n = body.get("n", 1) if body.get("n") is not None else 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise BadParam(f"n must be an integer in 1..{MAX_CHOICES}, got {n!r}", "n")
    opts: dict = {"prompt": None, "messages": None, "input_ids": None}  # GenerationRequest's fields
    if kind == "chat":
        opts["messages"] = _messages(body.get("messages"))
    else:
        _prompt(body.get("prompt"), opts)
    opts["chat"] = chat_options(body, kind, opts["messages"])  # vLLM's chat_template_kwargs, ...
    max_tokens = _limits(body, kind, opts)
    tools, auto = tool_options(body, opts, kind, tool_format, tool_markers, tool_fold)
    _sampling(body, opts)
    logprobs_options(body, kind, opts)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadParam("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadParam("stream_options must be an object", "stream_options")
    echo, echo_only, max_tokens = echo_options(body, kind, opts, max_tokens, stream)
    ask = Ask(opts, tenant=tenant, max_new_tokens=max_tokens, return_token_ids=True)
    return OpenAIRequest(kind, model, ask, stream, bool(options.get("include_usage")), n, echo, echo_only, tools,
                         auto)


def choice_asks(req: OpenAIRequest) -> list[Ask]:
    """The Ask of each of the n choices: with a seed, choice i samples with seed + i (each choice
    reproducible, and different from the others); greedy choices are all the same text."""
    out = []
    for i in range(req.n):
        sampling = req.ask.options.get("sampling")
        if i and sampling is not None and sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + i) % (1 << 64))
        out.append(dataclasses.replace(req.ask, options={**req.ask.options, "sampling": sampling}))
    return out


def _check_unsupported(body: dict) -> None:
    for name, default in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != default and value != [] and value != {}:
            raise BadParam(f"{name} is not supported by this server; leave it out", name)


def tokenize_request(body: object) -> tuple[str | None, list[dict] | None, ChatOptions | None]:
    """vLLM's /tokenize body: {"prompt": text} or {"messages": [...]} ("model" optional, "add_special_tokens"
    accepted: the ids are always what Generate sees; with messages, chat_template_kwargs, add_generation_prompt
    and continue_final_message as a chat request's): (text, messages, chat options)."""
    if not isinstance(body, dict):
        raise BadParam("the request body must be a JSON object")
    if ("prompt" in body) == ("messages" in body):
        raise BadParam("give exactly one of prompt (text) or messages (a chat)", "prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise BadParam("prompt must be a string", "prompt")
        return body["prompt"], None, None
    messages = _messages(body["messages"])
    return None, messages, chat_options(body, "chat", messages)


def _messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadParam("messages must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise BadParam(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}", f"messages[{i}].role")
        calls = m.get("tool_calls") if role == "assistant" else None
        content = "" if calls and m.get("content") is None else _content(m.get("content"), i)
        turn = {"role": ROLES[role], "content": content, "tool_calls": calls,
                **{k: m[k] for k in ("tool_call_id", "name") if role == "tool" and m.get(k) is not None}}
        try:  # earlier calls and tool_call_id as the template reads them (engine/request/history.py)
            out.append(chat_turn(turn, i))
        except InvalidArgument as e:
            raise BadParam(str(e), f"messages[{i}]") from None
    return out


def _content(content: object, i: int) -> str:
    """A string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadParam(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _prompt(prompt: object, opts: dict) -> None:
    """A string, a list of one string, or a list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        opts["prompt"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        opts["input_ids"] = list(prompt)
    else:
        raise BadParam("prompt must be a string, a list of one string, or a list of token ids", "prompt")


def _limits(body: dict, kind: str, opts: dict) -> object:
    """Stops, EOS, rules, structured output and mode onto `opts`; max_tokens (or chat's
    max_completion_tokens) as given, None where neither is: the front door checks it."""
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    given = [(n, body[n]) for n in names if body.get(n) is not None]
    if len({v for _, v in given if isinstance(v, int)}) > 1:
        raise BadParam("max_tokens and max_completion_tokens differ: give one", "max_tokens")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadParam("stop must be a string or a list of strings", "stop")
    opts["stop_strings"] = tuple(stops)
    stop_ids = body.get("stop_token_ids")  # vLLM's: stop after any of these ids (kept, as EOS is)
    if stop_ids is not None and (not isinstance(stop_ids, list) or
                                 not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)):
        raise BadParam("stop_token_ids must be a list of token ids", "stop_token_ids")
    opts["stop_token_ids"] = tuple(stop_ids or ())
    ignore_eos = body.get("ignore_eos", False)  # vLLM's: decode on through EOS (benchmarks)
    if not isinstance(ignore_eos, bool):
        raise BadParam("ignore_eos must be true or false", "ignore_eos")
    opts["ignore_eos"] = ignore_eos
    rules_options(body, opts)
    structured_options(body, opts)
    mode = body.get("mode", "tr")  # trserve's own: "ar" = plain decoding
    if mode not in MODES:
        raise BadParam(f"mode must be one of {sorted(MODES)}, got {mode!r}", "mode")
    opts["mode"] = mode
    return given[0][1] if given else None


def _sampling(body: dict, opts: dict) -> None:
    """temperature unset or 0 = greedy (as over gRPC); top_p, seed, vLLM's min_p and top_k apply when sampling."""
    values = {}
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float), ("seed", int)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise BadParam(f"{name} must be a number, got {value!r}", name)
        values[name] = value
    if not 0 <= values.get("temperature", 0) <= 2:
        raise BadParam(f"temperature must be in [0, 2], got {values['temperature']}", "temperature")
    if not 0 < values.get("top_p", 1) <= 1:
        raise BadParam(f"top_p must be in (0, 1], got {values['top_p']}", "top_p")
    if values.get("top_k", 0) < 0:
        raise BadParam(f"top_k must be >= 0 (0 = off), got {values['top_k']}", "top_k")
    if not 0 <= values.get("min_p", 0) <= 1:
        raise BadParam(f"min_p must be in [0, 1] (0 = off), got {values['min_p']}", "min_p")
    if "seed" in values and not 0 <= values["seed"] < 1 << 64:
        raise BadParam(f"seed must be in [0, 2**64), got {values['seed']}", "seed")
    params = SamplingParams(temperature=f32(values.get("temperature", 0)), top_k=values.get("top_k", 0),
                            top_p=f32(values.get("top_p", 1)), min_p=f32(values.get("min_p", 0)),
                            seed=values.get("seed"))
    opts["sampling"] = None if params.greedy else params


# ---- answers ------------------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(stats: GenerationStats, *more: GenerationStats) -> dict:
    """OpenAI's usage of a choice, or of n choices (the prompt counted once, completions summed)."""
    every = (stats, *more)
    accepted = sum(sum(s.accepted.values()) for s in every)
    drafted = sum(sum(s.drafted.values()) for s in every)
    generated = sum(s.generated_tokens for s in every)
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": generated,
            "total_tokens": stats.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted}}


def extras(result: GenerationResult, finish_reason: str, queue_s: float, tenant: str) -> dict:
    """trserve's own figures: MAT, drafts per source, the raw finish reason, token ids."""
    s = result.stats
    sources = {name: {"drafted": n, "accepted": s.accepted.get(name, 0)} for name, n in sorted(s.drafted.items())}
    return {"mat": s.mat, "draft_sources": sources, "steps": s.steps, "draft_mode": s.draft_mode, "tree": s.tree,
            "finish_reason": finish_reason, "tenant": tenant, "queue_ms": queue_s * 1e3,
            "tokens_per_second": s.tokens_per_s, "token_ids": list(result.ids)}


def completion(req: OpenAIRequest, result: GenerationResult | list[GenerationResult], queue_s: float,
               fingerprint: str, vocab: Vocabulary, tenant: str) -> dict:
    """The non-streamed answer, of one result or of each choice's; `vocab`: the tokens' bytes and text
    (for logprobs and echo); `tenant`: whose call it was. trserve's own figures are the first choice's."""
    results = result if isinstance(result, list) else [result]
    choices = []
    for i, r in enumerate(results):
        text, logprobs = ("", () if r.logprobs is not None else None) if req.echo_only else (r.text, r.logprobs)
        if req.echo is not None:  # completions' echo: the prompt first, its logprobs too where asked
            prompt = req.echo or vocab.text(list(req.ask.options["input_ids"]))  # "": a prompt of token ids
            text = prompt + text
            logprobs = (*r.prompt_logprobs, *logprobs) if logprobs is not None else None
        choice: dict = {"index": i, "finish_reason": "length" if req.echo_only else FINISH[r.finish_reason],
                        "logprobs": logprobs_json(req.kind, logprobs, vocab)}
        calls = required_calls(text, req.tools) if req.tools and r.finish_reason == "grammar" else None
        if calls:
            choice.update(finish_reason="tool_calls", message={"role": "assistant", "content": None, "tool_calls": calls})
        elif req.auto is not None:
            choice.update(auto_choice(req.auto, text, choice["finish_reason"]))
        elif req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choices.append(choice)
    first, spent = results[0], usage(*(r.stats for r in results))
    if req.echo_only:  # the one token decoded was dropped
        spent.update(completion_tokens=0, total_tokens=spent["prompt_tokens"])
    return {"id": new_id(req.kind), "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": req.model, "system_fingerprint": fingerprint,
            "choices": choices, "usage": spent,
            "trserve": extras(first, first.finish_reason, queue_s, tenant)}


@dataclass
class ChunkWriter:
    """The chunks of one streamed answer (same id and creation time)."""

    req: OpenAIRequest
    id: str
    created: int
    fingerprint: str
    vocab: Vocabulary | None = None  # the tokens' bytes and text (for logprobs)
    offset: int = 0  # characters of text the chunks' logprobs have covered (completions' text_offset)
    held: str = ""  # a tool call's text so far: sent whole as tool_calls at the end
    index: int = 0  # the choice these chunks are of (n > 1: one writer per choice, one id)
    started: bool = False  # a chunk was sent (the first carries the role)
    reader: AutoStream | None = None  # tool_choice "auto": this choice's text read for calls

    @classmethod
    def of(cls, req: OpenAIRequest, fingerprint: str, vocab: Vocabulary | None = None) -> ChunkWriter:
        return cls(req, new_id(req.kind), int(time.time()), fingerprint, vocab)

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              token_ids: list[int] | None = None, logprobs=None) -> dict:
        if self.req.tools and finish_reason is None:
            self.held, text = self.held + (text or ""), None
        calls = None
        if self.req.auto is not None and finish_reason is None:
            self.reader = self.reader or AutoStream(self.req.auto)
            text, calls = self.reader.feed(text)
        lp = logprobs_json(self.req.kind, logprobs, self.vocab, self.offset) if logprobs else None
        if lp is not None and self.req.kind != "chat":
            self.offset = self.vocab.offsets([x.token for x in logprobs], self.offset)[1]
        choice: dict = {"index": self.index, "finish_reason": finish_reason, "logprobs": lp}
        if self.req.kind == "chat":
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = self._wrap([choice])
        if token_ids is not None:
            out["trserve"] = {"token_ids": list(token_ids)}
        return out

    def last_chunk(self, text: str, result: GenerationResult, finish_reason: str, queue_s: float, tenant: str) -> dict:
        """The finish reason (and any held-back text, or the tool call), with trserve's figures."""
        calls = required_calls(self.held + text, self.req.tools) if self.req.tools and finish_reason == "grammar" else None
        if calls:
            out = self.chunk(None, "tool_calls")
            out["choices"][0]["delta"]["tool_calls"] = [{"index": 0, **calls[0]}]
        elif self.req.auto is not None:
            out = self._auto_last(text, FINISH[finish_reason])
        else:
            out = self.chunk((self.held + text) or None, FINISH[finish_reason])
        out["trserve"] = extras(result, finish_reason, queue_s, tenant)
        return out

    def _auto_last(self, text: str, finish_reason: str) -> dict:
        """tool_choice "auto"'s last chunk: the rest of the reply read for calls (tools.py:AutoStream)."""
        self.reader = self.reader or AutoStream(self.req.auto)
        content, calls, finish_reason, stop_reason = self.reader.end(text, finish_reason)
        out = self.chunk(content, finish_reason)
        if calls:
            out["choices"][0]["delta"]["tool_calls"] = calls
        if stop_reason:
            out["choices"][0]["stop_reason"] = stop_reason
        return out

    def choices(self, n: int) -> list[ChunkWriter]:
        """One writer per choice of an n-choice stream: the same id and time, each its own index."""
        return [dataclasses.replace(self, index=i) for i in range(n)]

    def usage_chunk(self, result: GenerationResult, finish_reason: str, queue_s: float, tenant: str,
                    others: tuple[GenerationResult, ...] = ()) -> dict:
        """Usage of the whole answer (every choice's tokens, the prompt once), trserve's figures of `result`."""
        out = self._wrap([])
        out["usage"] = usage(result.stats, *(r.stats for r in others))
        out["trserve"] = extras(result, finish_reason, queue_s, tenant)
        return out

    def _wrap(self, choices: list[dict]) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.req.kind == "chat" else "text_completion",
               "created": self.created, "model": self.req.model, "system_fingerprint": self.fingerprint,
               "choices": choices}
        if self.req.include_usage:
            out["usage"] = None
        return out
