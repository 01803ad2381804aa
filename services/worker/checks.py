"""What one Generate call may ask, checked once for both edges (gRPC, services/worker/servicer.py, and
HTTP, services/openai/app.py) by the front door (front.py), before anything is tokenized.

Each edge turns its own wire format into an `Ask`: the engine request's fields as the caller gave them,
unchecked, with the tenant and max_new_tokens left None where the caller left them out. `check_call` is
the one place that checks them against this server's limits; each limit is one function here with one
message, so a request refused over gRPC and over HTTP reads the same:

- the tenant and the domain: `core/tenants.py:validate_tenant_id` (`tenant_of`);
- max_new_tokens: `engine/request/request.py:check_max_new_tokens` with the server's cap;
- the prompt's size before tokenizing (`check_prompt_size`: characters, chat turns, token ids) and its
  tokens after (`check_prompt_length`);
- stops (`check_stops`) and trees (builtin names only: `tree_name`).

The request's own rules (sampling, penalties, logprobs, min_tokens...) are the engine's GenerationRequest's,
checked as it is built here; the model's (ids in the vocabulary, prompt + max_new_tokens within the
context) by `engine/target.py:TargetModel.prepare`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...core.errors import InvalidArgument, NotFound
from ...core.tenants import validate_tenant_id
from ...engine.request.history import calls_chars
from ...engine.request.request import GenerationRequest, check_max_new_tokens
from ...engine.tr.tree import builtin_trees
from .config import MESSAGE_OVERHEAD_CHARS, Limits


class InvalidField(InvalidArgument):
    """A refused request field; `field` is its edge-neutral name ("tenant", "max_new_tokens"), which
    each edge may show as its own (OpenAI's error.param)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Ask:
    """One generation as an edge hands it to the front door, not yet checked. `options`: the keyword
    arguments of engine/request/request.py:GenerationRequest but max_new_tokens (a prompt, messages or
    input ids; stops, mode, tree, sampling, logprobs, rules, structured output). None for the tenant or
    max_new_tokens: the server's default."""

    options: Mapping[str, Any] = field(default_factory=dict)
    tenant: str | None = None
    domain: str | None = None
    max_new_tokens: int | None = None
    return_token_ids: bool = False


@dataclass(frozen=True)
class GenerateCall:
    """A checked Ask: who asks (tenant, domain), what the engine runs, what to return."""

    tenant: str
    domain: str | None
    request: GenerationRequest  # validated by the engine type itself
    return_token_ids: bool


def check_call(ask: Ask, limits: Limits, default_tenant: str) -> GenerateCall:
    """The Ask checked against this server's limits, and its engine request built (and so checked)."""
    tenant = tenant_of(ask.tenant, default_tenant)
    domain = tenant_of(ask.domain, what="domain") if ask.domain is not None else None
    options = dict(ask.options)
    check_prompt_size(options.get("prompt"), options.get("messages"), options.get("input_ids"), limits)
    check_stops(options.get("stop_strings", ()), options.get("stop_token_ids", ()), limits)
    options["tree"] = tree_name(options.get("tree"))
    if ask.max_new_tokens is None:
        n = limits.default_max_new_tokens
    else:
        try:
            n = check_max_new_tokens(ask.max_new_tokens, limits.max_new_tokens_cap, limits.default_max_new_tokens)
        except InvalidArgument as exc:
            raise InvalidField(str(exc), "max_new_tokens") from None
    request = GenerationRequest(**options, max_new_tokens=n)
    return GenerateCall(tenant=tenant, domain=domain, request=request, return_token_ids=ask.return_token_ids)


def tenant_of(asked: str | None, default: str | None = None, what: str = "tenant") -> str:
    """The tenant (or domain) a call names, `default` where it names none: checked here, for both edges."""
    try:
        return validate_tenant_id((asked or default) if default is not None else asked, what)
    except InvalidArgument as exc:
        raise InvalidField(str(exc), what) from None


def check_prompt_size(text: str | None, messages: list[dict] | None, ids: list[int] | None, limits: Limits) -> None:
    """A prompt's size before anything is built or tokenized (exactly one of the three is given; the
    engine's request says so where not)."""
    if text is not None and len(text) > limits.max_prompt_chars:
        raise InvalidArgument(f"prompt text has {len(text)} characters; the limit is {limits.max_prompt_chars} "
                              f"(and {limits.max_prompt_tokens} tokens): shorten it")
    if messages is not None:
        if len(messages) > limits.max_messages:
            raise InvalidArgument(f"{len(messages)} chat messages given; at most {limits.max_messages}: "
                                  "send fewer turns")
        # content plus each turn's markup, before anything is built or tokenized
        size = sum(len(m["content"]) + calls_chars(m) + len(m["role"]) + MESSAGE_OVERHEAD_CHARS for m in messages)
        if size > limits.max_prompt_chars:
            raise InvalidArgument(f"messages have {size} characters (content and tool calls, plus {MESSAGE_OVERHEAD_CHARS} "
                                  f"per message); the limit is {limits.max_prompt_chars} "
                                  f"(and {limits.max_prompt_tokens} tokens): shorten them")
    if ids is not None:
        check_prompt_length(len(ids), limits)


def check_prompt_length(n_tokens: int, limits: Limits) -> None:
    """The server's prompt limit, in tokens (token ids as given, or a prompt once tokenized)."""
    if n_tokens > limits.max_prompt_tokens:
        raise InvalidArgument(f"prompt has {n_tokens} tokens; this server accepts at most {limits.max_prompt_tokens}: "
                              "shorten it")


def check_stops(strings, token_ids, limits: Limits) -> None:
    if len(strings) > limits.max_stop_sequences:
        raise InvalidArgument(f"{len(strings)} stop sequences given; at most {limits.max_stop_sequences}")
    longest = max((len(s) for s in strings), default=0)
    if longest > limits.max_stop_sequence_chars:
        raise InvalidArgument(f"a stop sequence has {longest} characters; the limit is "
                              f"{limits.max_stop_sequence_chars}: shorten it")
    if len(token_ids) > limits.max_stop_token_ids:
        raise InvalidArgument(f"{len(token_ids)} stop token ids given; at most {limits.max_stop_token_ids}")


def tree_name(name: object) -> str | None:
    """Requests may only name builtin trees (never a server-side file path)."""
    if not name:
        return None
    if name not in builtin_trees():
        raise NotFound(f"unknown tree {name!r}: use one of {builtin_trees()} or leave it empty for the server default")
    return name
