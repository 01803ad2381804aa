"""The one request type of the engine, and its model-bound, validated form.

`GenerationRequest` is what a caller asks for (the worker builds it once from the protobuf; Python
users build it directly); everything checkable without the model is checked when it is built.
`Decoder.prepare` checks the rest against the model (ids in the vocabulary, context budget, tree)
and returns a `PreparedRequest`: the only thing the decode loop consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.errors import InvalidArgument
from ..tr.grammar import CompiledGrammar, StructuredOutput
from .chat import ChatOptions
from ..tr.sampling import SamplingParams
from ..tr.tree import CompiledTree, TreeTemplate

MODES = ("tr", "ar")


def check_max_new_tokens(n: object, cap: int | None = None, default: int | None = None) -> int:
    """The one check of a request's max_new_tokens, with one message: an integer in [1, cap]. A server's
    front door (services/worker/checks.py:check_call) passes its cap and default before it builds the
    request; a GenerationRequest built directly (bench, Python users) has no cap and checks the same way."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (cap is not None and n > cap):
        unset = f" (leave it unset for the default, {default})" if default is not None else ""
        bound = f"in [1, {cap}]" if cap is not None else "a positive integer"
        raise InvalidArgument(f"max_new_tokens must be {bound}, got {n!r}{unset}")
    return n


@dataclass(frozen=True)
class GenerationRequest:
    """Exactly one of `prompt` (raw text, no chat template), `messages` (chat template applied) or
    `input_ids`. `stop_token_ids` add to the model's EOS ids (`ignore_eos` drops those, e.g. for
    fixed-length benchmarks). `tree`: a builtin name, a JSON file path, a template or compiled tree;
    None = the decoder's default (or the caller's online tuner). `sampling`: None or temperature 0
    decodes greedily; otherwise tokens are sampled losslessly (engine/tr/sampling.py)."""

    prompt: str | None = None
    messages: tuple[dict, ...] | list[dict] | None = None
    input_ids: tuple[int, ...] | list[int] | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    mode: str = "tr"  # "tr" (Token Recycling) or "ar" (plain decoding, same kernels)
    tree: str | TreeTemplate | CompiledTree | None = None
    sampling: SamplingParams | None = None
    # per committed token, its log-probability under the model (engine/tr/logprobs.py) and, when > 0,
    # that many most likely alternatives (0..20); None = none computed
    logprobs: int | None = None
    # the same for every prompt token after the first (from the prefill's logits; the prompt then never
    # comes from the prefix cache): None = none computed
    prompt_logprobs: int | None = None
    # logit rules (engine/tr/rules.py), lossless under TR: (token id, amount added to its logit, in
    # [-100, 100]) pairs, and no stop id (EOS or stop_token_ids) among the first `min_tokens` tokens
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # repetition penalties (engine/tr/rules.py), lossless under TR too: 1 / 0 / 0 = off
    repetition_penalty: float = 1.0  # in (0, 10]
    frequency_penalty: float = 0.0  # in [-2, 2]
    presence_penalty: float = 0.0  # in [-2, 2]
    # the output must follow this grammar (engine/tr/grammar.py; lossless under TR); None = free text
    structured: StructuredOutput | None = None
    # with `messages`: template kwargs, add_generation_prompt, continue_final_message (chat.py); None = defaults
    chat: ChatOptions | None = None
    # tools the chat template describes to the model (OpenAI's [{"type": "function", "function": {...}}];
    # engine/request/tools.py picks the template); None = none. The reply is text: the caller reads calls in it
    tools: tuple[dict, ...] | None = None
    # special token ids the reply's text keeps as their text (it is decoded without special tokens
    # otherwise, as vLLM's skip_special_tokens): a tool-call marker the reply is read for (Mistral's
    # [TOOL_CALLS] after text, services/openai/toolchoice.py)
    kept_special: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.prompt, self.messages, self.input_ids)) != 1:
            raise InvalidArgument("give exactly one of: prompt text, chat messages, or input token ids")
        if self.mode not in MODES:
            raise InvalidArgument(f"mode must be one of {MODES}, got {self.mode!r}")
        check_max_new_tokens(self.max_new_tokens)
        if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
            raise InvalidArgument(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20):
                raise InvalidArgument(f"{name} must be None or the alternatives per token, 0..20; got {value!r}")
        try:
            bias = tuple((int(i), float(b)) for i, b in (self.logit_bias.items() if isinstance(self.logit_bias, dict)
                                                         else self.logit_bias))
        except (TypeError, ValueError):
            raise InvalidArgument("logit_bias must map token ids to numbers") from None
        if any(not -100 <= b <= 100 for _, b in bias) or len({i for i, _ in bias}) != len(bias) or len(bias) > 300:
            raise InvalidArgument("logit_bias takes at most 300 distinct token ids, each biased by -100..100")
        object.__setattr__(self, "logit_bias", bias)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidArgument(f"min_tokens must be in 0..max_new_tokens ({self.max_new_tokens}), got {self.min_tokens!r}")
        for name, lo, hi in (("repetition_penalty", 0.0, 10.0), ("frequency_penalty", -2.0, 2.0),
                             ("presence_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi or \
                    (name == "repetition_penalty" and value == 0):
                raise InvalidArgument(f"{name} must be a number in {'(' if lo == 0 else '['}{lo:g}, {hi:g}], got {value!r}")
        if self.chat is not None:
            if not isinstance(self.chat, ChatOptions) or self.messages is None:
                raise InvalidArgument("chat options (chat_template_kwargs, add_generation_prompt, "
                                      "continue_final_message) need chat messages and a ChatOptions")
            self.chat.check_messages(self.messages)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidArgument(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if self.tools is not None:
            if self.messages is None or not isinstance(self.tools, (list, tuple)) or \
                    not all(isinstance(t, dict) for t in self.tools):
                raise InvalidArgument("tools are a list of objects, for chat messages only")
            object.__setattr__(self, "tools", tuple(self.tools))
        stops = tuple(self.stop_strings)
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidArgument("stop strings must not be empty (an empty string stops nothing): remove it")
        object.__setattr__(self, "stop_strings", stops)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "kept_special", tuple(self.kept_special))

    @property
    def uses_default_tree(self) -> bool:
        """TR with no tree named: the decoder's default tree, or the caller's online tuner, drafts.
        (A named tree always wins over a tuner.)"""
        return self.mode == "tr" and self.tree is None


@dataclass(frozen=True, repr=False)
class PreparedRequest:
    """A GenerationRequest checked against one Decoder's model: what the decode loop runs."""

    request: GenerationRequest
    ids: tuple[int, ...]  # prompt token ids, each in [0, V)
    tree: CompiledTree | None  # the tree verified (the tuner's universe when tuned); None for "ar"
    stop_ids: frozenset[int] = field(default_factory=frozenset)  # EOS (unless ignored) + the request's
    grammar: CompiledGrammar | None = None  # the request's structured output, checked against the model

    def __repr__(self) -> str:
        tree = self.tree.template.name if self.tree is not None else None
        return f"PreparedRequest(prompt={len(self.ids)} tokens, mode={self.request.mode!r}, tree={tree!r})"
