"""Request options beyond the basics (services/openai/convert.py parses the rest): logprobs, echo
(prompt logprobs), the logit rules (logit_bias, min_tokens) and structured output (response_format,
vLLM's guided_* and structured_outputs), each onto the engine request's fields (`opts`, the options of
services/worker/checks.py:Ask); and OpenAI's logprobs object of an answer."""

from __future__ import annotations

import codecs
import functools
import struct

import json

from ...engine.tr.grammar import StructuredOutput
from .errors import BadParam


def echo_options(body: dict, kind: str, opts: dict, max_tokens: object,
                 stream: bool) -> tuple[str | None, bool, object]:
    """completions' echo: the prompt before the text (and its logprobs, with logprobs N: what
    lm-evaluation-harness scores with, echo=true, logprobs=1, max_tokens=0). Unary only.
    (echo text, echo only, max_tokens): max_tokens 0 with echo asks the engine for 1 token (dropped)."""
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadParam("echo must be true or false", "echo")
    if not echo:
        return None, False, max_tokens  # 0 without echo: refused by the front door's check, as any count
    if kind == "chat" or stream:
        raise BadParam("echo is answered for unary completions only", "echo")
    opts["prompt_logprobs"] = opts.get("logprobs")  # scored only where logprobs are asked: echo alone needs no logits
    only = isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens == 0
    return (opts["prompt"] if opts.get("prompt") is not None else ""), only, 1 if only else max_tokens


def rules_options(body: dict, opts: dict) -> None:
    """OpenAI's logit_bias {"token id": -100..100}, frequency and presence penalties, vLLM's min_tokens and
    repetition_penalty (engine/tr/rules.py)."""
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadParam('logit_bias must be an object {"token id": bias}', "logit_bias")
        biases = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise BadParam(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise BadParam(f"logit_bias values must be numbers in -100..100, got {value!r}", "logit_bias")
            biases[token] = f32(value)
        opts["logit_bias"] = tuple(sorted(biases.items()))
    for name, lo, hi in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0),
                         ("repetition_penalty", 0.0, 10.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi or \
                (name == "repetition_penalty" and value == 0):
            raise BadParam(f"{name} must be a number in {'(' if lo == 0 else '['}{lo:g}, {hi:g}], got {value!r}", name)
        opts[name] = f32(value)
    minimum = body.get("min_tokens")
    if minimum is not None:
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 0:
            raise BadParam(f"min_tokens must be an integer >= 0, got {minimum!r}", "min_tokens")
        opts["min_tokens"] = minimum


def logprobs_options(body: dict, kind: str, opts: dict) -> None:
    """chat: `logprobs` true/false and `top_logprobs` 0..20; completions: `logprobs` = the alternatives
    per token, 0..20 (OpenAI allows 5; vLLM 20), null = none."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "chat":
        if logprobs is not None and not isinstance(logprobs, bool):
            raise BadParam("logprobs must be true or false", "logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
                raise BadParam(f"top_logprobs must be an integer in 0..20, got {top!r}", "top_logprobs")
            if not logprobs:
                raise BadParam("top_logprobs needs logprobs: true", "top_logprobs")
        opts["logprobs"] = (top or 0) if logprobs else None
        return
    if top is not None:
        raise BadParam("top_logprobs is a chat field; completions take logprobs: N", "top_logprobs")
    if logprobs is None:
        return
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 20:
        raise BadParam(f"logprobs must be an integer in 0..20 (alternatives per token), got {logprobs!r}", "logprobs")
    opts["logprobs"] = logprobs


class Vocabulary:
    """The served model's tokens as logprobs and echo show them. `token_bytes(id)`: a token's own bytes
    (a token may hold part of a character: an emoji or a CJK character is often split over two or three)."""

    def __init__(self, tokenizer, token_bytes) -> None:
        self._tokenizer = tokenizer
        self.bytes = functools.lru_cache(maxsize=1 << 16)(token_bytes)

    def piece(self, token: int) -> str:
        """A token's text where its bytes are whole UTF-8, else OpenAI's spelling of raw bytes
        ("bytes:\\xf0\\x9f"); `bytes` in the logprobs carries the bytes themselves either way."""
        raw = self.bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def text(self, ids: list[int]) -> str:
        """The text of token ids together (characters split across tokens whole)."""
        return self._tokenizer.decode(list(ids))

    def offsets(self, ids: list[int], offset: int = 0) -> tuple[list[int], int]:
        """Each token's character offset in the text of `ids` after `offset` characters, and the offset
        after them all (a character split over tokens counts at its last byte), in one pass."""
        decoder, out = codecs.getincrementaldecoder("utf-8")(errors="ignore"), []
        for i in ids:
            out.append(offset)
            offset += len(decoder.decode(self.bytes(i)))
        return out, offset


def logprobs_json(kind: str, logprobs, vocab: Vocabulary, offset: int = 0) -> dict | None:
    """OpenAI's logprobs object of these tokens (engine TokenLogprobs; None where none were asked):
    chat's {"content": [...]} with each token's own bytes, or completions' tokens / token_logprobs /
    top_logprobs / text_offset (`offset`: the characters of completion text before the first of them)."""
    if logprobs is None:
        return None
    if kind == "chat":
        def entry(token: int, logprob: float) -> dict:
            return {"token": vocab.piece(token), "logprob": logprob, "bytes": list(vocab.bytes(token))}
        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for lp in logprobs], "refusal": None}
    ids = [lp.token for lp in logprobs]
    offsets, _ = vocab.offsets(ids, offset)
    return {"tokens": [vocab.piece(i) for i in ids], "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{vocab.piece(i): v for i, v in lp.top} if lp.logprob is not None else None
                             for lp in logprobs] if any(lp.top for lp in logprobs) else None, "text_offset": offsets}


# vLLM's spellings of a structured output (extra_body), old and new, by the kind each names
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}


def structured_options(body: dict, opts: dict) -> None:
    """OpenAI's response_format (json_object; json_schema, enforced whether `strict` or not) and vLLM's
    guided_json / guided_regex / guided_choice / guided_grammar and structured_outputs {json, regex,
    choice, grammar, json_object}: at most one, as the engine request's `structured`."""
    asked: list[tuple[str, str, object]] = []  # (field, kind, value)
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise BadParam('response_format must be {"type": "text" | "json_object" | "json_schema", ...}',
                           "response_format")
        if fmt["type"] == "json_object":
            asked.append(("response_format", "json_object", True))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise BadParam('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                               "response_format")
            asked.append(("response_format", "json_schema", spec.get("schema", {})))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            asked.append((name, kind, body[name]))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise BadParam("structured_outputs must be an object such as {\"json\": {...}}", "structured_outputs")
        for key, value in outputs.items():
            if key not in STRUCTURED and value is not None:
                raise BadParam(f"structured_outputs.{key} is not supported; use one of {sorted(STRUCTURED)}",
                               "structured_outputs")
            if key in STRUCTURED and value is not None and value is not False:
                asked.append(("structured_outputs", STRUCTURED[key], value))
    if not asked:
        return
    if len(asked) > 1:
        raise BadParam(f"give one structured output, not {len(asked)} ({', '.join(f for f, _, _ in asked)})", asked[1][0])
    field, kind, value = asked[0]
    if kind == "json_object":
        opts["structured"] = StructuredOutput("json_object")
    elif kind == "json_schema":
        if isinstance(value, str):
            opts["structured"] = StructuredOutput("json_schema", value)
        elif isinstance(value, (dict, bool)):
            opts["structured"] = StructuredOutput("json_schema", json.dumps(value))
        else:
            raise BadParam(f"{field}: a JSON schema is an object", field)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise BadParam(f"{field}: a choice is a list of non-empty strings", field)
        opts["structured"] = StructuredOutput("choice", choices=tuple(value))
    else:
        if not isinstance(value, str) or not value:
            raise BadParam(f"{field}: a {kind} is a non-empty string", field)
        opts["structured"] = StructuredOutput(kind, value)


def f32(x: float) -> float:
    """`x` as a 32-bit float: the number a gRPC caller's float field carries, so both APIs sample and
    bias alike (and HTTP as it did when it went through protobuf)."""
    return struct.unpack("f", struct.pack("f", x))[0]
