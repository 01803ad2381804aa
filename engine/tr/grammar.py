"""Structured output: a grammar every committed token must follow (JSON schema, any JSON object, a
regex, a choice of strings, or a Lark grammar), enforced with llguidance.

llguidance was picked over xgrammar for CPU workers: its one MIT wheel (abi3, ~3 MB, every Python
from 3.10) needs nothing else, where xgrammar's pulls torch's triton and a TVM runtime; a mask over
this 49,152-token vocabulary takes 10-20 us. vLLM and SGLang ship it as a backend too.

How it keeps TR lossless. A grammar is a logit rule that reads the tokens before a row
(engine/tr/rules.py): at a row predicting output position t, the ids the grammar forbids after
the output so far (for a tree node: the committed output plus its path's drafts) get -inf, then the
argmax (or the seeded sample) is taken as without a grammar. Plain decoding does exactly that at
position t, so each node's choice is plain decoding's choice there and acceptance keeps what plain
decoding would have emitted. The grammar only ever sees committed tokens (`take`); a path is
checked by consuming it and rolling it back.

Grammar-aware drafting (engine/drafting/constrained.py) uses the same matcher: tokens the grammar forces
next are drafted as a certain chain, and drafted nodes it forbids are cut before the forward, since
no choice under the mask can accept them.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import torch

from ...core.errors import InvalidArgument, OutputStuck

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it: one space after ':' and ',' and none elsewhere. Small models ramble
# whitespace where it is free (vLLM's default); this keeps replies compact and forces more tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_CHARS = 100_000
# Tokens a new grammar is walked at validation (the lowest id it allows, or what it forces, each step):
# the grammar engine's limits (items a parser row, lexer states) mostly bite in the first tokens, and a
# request that would hit them there is refused with the limit's words before it takes a row.
PROBE_TOKENS = 4


def engine_error(matcher) -> str:
    """The first line of the grammar engine's error (the rest is its parser state dump)."""
    return (matcher.get_error() or "unknown error").strip().splitlines()[0]


@dataclass(frozen=True)
class StructuredOutput:
    """What a request constrains its output to. `kind` json_schema: `spec` is the schema as JSON text;
    json_object: any JSON object (`spec` unused); regex: `spec` is a regular expression (Rust regex
    syntax, the whole output must match); choice: `choices`, one of those strings exactly; grammar:
    `spec` is a Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's, converted)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidArgument(f"a structured output spec is text of at most {MAX_SPEC_CHARS} characters")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if not self.choices or any(not isinstance(c, str) or not c for c in self.choices):
                raise InvalidArgument("a choice needs at least one non-empty string to choose from")
        elif self.kind in ("regex", "grammar", "json_schema") and not self.spec.strip():
            raise InvalidArgument(f"structured output {self.kind!r} needs its {self.kind.replace('_', ' ')}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise InvalidArgument(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidArgument("a JSON schema must be a JSON object (or true / false)")

    def grammar(self) -> str:
        """The llguidance grammar text of this spec."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":  # JSON string literals are Lark string literals
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choices))
        from llguidance.gbnf_to_lark import any_to_lark

        return LLMatcher.grammar_from_lark(any_to_lark(self.spec))  # GBNF (llama.cpp's, vLLM's) converted


class GrammarCompiler:
    """One model's grammars: its tokenizer in llguidance's form (built once, ~0.5 s, on first use)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._hf, self.vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self._eos[0] if self._eos else None)
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The checked grammar of `spec`; InvalidArgument with the grammar engine's message if it is not one."""
        from llguidance import LLMatcher

        try:
            text = spec.grammar()
        except RecursionError:  # the GBNF converter recurses per nested group
            raise InvalidArgument(f"structured output {spec.kind!r} nests too deeply to be read") from None
        except Exception as e:  # noqa: BLE001 - the converters raise their own (GbnfToLarkError, bare Exception)
            raise InvalidArgument(f"structured output {spec.kind!r} cannot be read: "
                                  f"{type(e).__name__}: {str(e).strip() or 'no message'}") from None
        tok = self.tokenizer()
        error = LLMatcher.validate_grammar(text, tok)
        if error and not error.startswith("WARNING"):
            raise InvalidArgument(f"structured output {spec.kind!r} cannot be compiled: {error.strip()}")
        compiled = CompiledGrammar(spec, text, tok, self.vocab_size)
        compiled.probe(self._eos)
        return compiled


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked grammar for one model; `matcher()` starts a request's own state."""

    spec: StructuredOutput
    text: str
    tokenizer: object
    vocab_size: int

    def matcher(self) -> Grammar:
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, self.text, log_level=0)
        if m.is_error():
            raise InvalidArgument(f"structured output {self.spec.kind!r}: {engine_error(m)}")
        return Grammar(m, self.vocab_size, self.spec.kind)

    def first(self) -> torch.Tensor:
        """[V] bool: the ids the grammar allows as the output's first token."""
        return self.matcher().allowed([[]])[0]

    def probe(self, eos: list[int]) -> None:
        """Refuse at validation (InvalidArgument naming why) a grammar that can match no output, one
        that allows only the empty output where a JSON value is required, and one that hits a limit of
        the grammar engine within its first PROBE_TOKENS tokens (walking the lowest allowed id)."""
        g, kind = self.matcher(), self.spec.kind
        try:
            g.allowed([[]])
        except OutputStuck as e:  # no token, not even the stop, can start it
            raise InvalidArgument(f"structured output {kind!r} can match no output (the grammar engine: {e.why}); "
                                  "check it for a rule that only refers to itself, an empty character class or a $ref loop") from None
        if kind in ("json_schema", "json_object") and g.m.is_accepting():
            raise InvalidArgument(f"structured output {kind!r} matches only the empty output, which is not a "
                                  "JSON value: check the schema's $ref and types")
        try:
            for _ in range(PROBE_TOKENS):
                ids = g.forced()[:1]
                if not ids:
                    ok = g.allowed([[]])[0]  # [V]
                    ok[list(eos)] = False
                    ids = ok.nonzero().flatten()[:1].tolist()
                if not ids or g.take(ids) == 0 or g.done:
                    return
        except OutputStuck as e:
            raise InvalidArgument(f"structured output {kind!r} exceeds a limit of the grammar engine within its "
                                  f"first {g.committed + 1} tokens: {e.why}; simplify it (fewer alternatives or "
                                  "optional properties at one level, shorter repetitions)") from None


class Grammar:
    """One request's grammar state, after its committed output tokens. Where the grammar engine cannot
    go on (a limit of its parser or lexer, or a path it refuses), OutputStuck: the request ends alone."""

    def __init__(self, matcher, vocab_size: int, kind: str = "grammar") -> None:
        self.m, self.vocab_size, self.kind = matcher, vocab_size, kind
        self.words = (vocab_size + 31) // 32
        self.committed = 0  # output tokens consumed
        self.done = False  # the grammar is complete and takes nothing more

    def allowed(self, paths: list[list[int]]) -> torch.Tensor:
        """paths [n] (tokens after the committed output) -> [n, V] bool: what each may be followed by."""
        bits = torch.zeros((len(paths), self.words), dtype=torch.int32)  # [n, V/32]
        for i, path in enumerate(paths):
            if path and not self.m.consume_tokens(path):  # the masks prevent it but for the engine's limits
                self._stuck(f"after {self.committed} output tokens, {len(path)} drafted")
            row = bits[i]
            self.m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if self.m.is_error():  # an error while masking leaves a mask of the stop alone: not the grammar's
                self._stuck(f"after {self.committed + len(path)} output tokens")
            if path:
                self.m.rollback(len(path))
        shifts = torch.arange(32, dtype=torch.int32)
        return ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(paths), -1)[:, : self.vocab_size]

    def mask(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """logits [n, V'] (V' >= V: ids past the tokenizer's are never allowed) -> the same with -inf
        where the grammar forbids the id after that row's path (in place)."""
        ok = self.allowed(paths).to(logits.device)  # [n, V]
        logits[:, : ok.shape[1]].masked_fill_(~ok, float("-inf"))
        logits[:, ok.shape[1]:] = float("-inf")
        return logits

    def take(self, tokens: list[int]) -> int:
        """Commits output tokens; returns how many it kept: all, or up to the one that completed the
        grammar (`done` then)."""
        for n, t in enumerate(tokens):
            if self.done:
                return n
            if not self.m.consume_token(t):
                self._stuck(f"at output token {self.committed}")
            self.committed += 1
            self.done = self.m.is_stopped()
        return len(tokens)

    def _stuck(self, where: str) -> None:
        raise OutputStuck(f"structured output {self.kind!r} cannot go on {where}: the grammar engine says "
                          f"{engine_error(self.m)!r}; simplify the grammar (fewer alternatives or optional "
                          "properties a level, shorter repetitions)", why=engine_error(self.m))

    def valid_prefix(self, path: list[int]) -> int:
        """How many leading tokens of `path` (after the committed output) the grammar allows."""
        return self.m.validate_tokens(path)

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (its only choices, whatever the model says); [] if none."""
        if self.done:
            return []
        forced = list(self.m.compute_ff_tokens())
        if self.m.is_error():
            self._stuck(f"after {self.committed} output tokens")
        return forced
