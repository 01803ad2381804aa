"""Logit rules a request may add before each choice: OpenAI's `logit_bias` (a fixed amount added to
chosen ids' logits), vLLM's `min_tokens` (no stop id before that many tokens), and the repetition
penalties: `repetition_penalty` (transformers' and vLLM's: a logit of an id already in the prompt or
output divided by it where positive, multiplied where negative), `frequency_penalty` and
`presence_penalty` (OpenAI's: minus the amount times the id's count in the output, minus the amount
once for an id that appeared).

What each rule reads is the row, the output position it predicts, and the tokens before that
position: for a tree node, the committed output plus the drafted tokens on its path, exactly what
plain decoding would have at that position. So a node's choice under the rules is plain decoding's
choice there, and TR stays lossless with them. The order on a row is fixed (repetition, frequency
and presence, bias, the min_tokens ban, then the request's grammar (engine/tr/grammar.py), which
forbids what it does not allow after the row's path), each id touched once per rule. Raw logits
still feed recycling."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from .grammar import Grammar


@dataclass(frozen=True)
class LogitRules:
    bias_ids: torch.Tensor  # [b] int64
    bias: torch.Tensor  # [b] float32, added to those ids' logits
    stop_ids: torch.Tensor  # [s] int64, banned (-inf) at output positions < min_tokens
    min_tokens: int
    repetition: float = 1.0  # 1 = off
    frequency: float = 0.0
    presence: float = 0.0
    prompt: frozenset[int] = frozenset()  # the prompt's ids (repetition_penalty counts them too)
    grammar: Grammar | None = None  # the request's structured output state (it changes as tokens commit)

    @classmethod
    def of(cls, request, stop_ids, prompt_ids, device, grammar: Grammar | None = None) -> LogitRules | None:
        """The rules of a GenerationRequest, or None where it has none (the fast path: raw argmax)."""
        r = request
        if not r.logit_bias and not (r.min_tokens and stop_ids) and r.repetition_penalty == 1.0 \
                and not r.frequency_penalty and not r.presence_penalty and grammar is None:
            return None
        ids = torch.tensor([i for i, _ in r.logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in r.logit_bias], dtype=torch.float32, device=device)
        stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        prompt = frozenset(prompt_ids) if r.repetition_penalty != 1.0 else frozenset()
        return cls(ids, bias, stops, r.min_tokens, r.repetition_penalty, r.frequency_penalty, r.presence_penalty,
                   prompt, grammar)

    @property
    def reads_context(self) -> bool:
        """Whether a row's rules depend on the tokens before it (then each tree node needs its path)."""
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0 or self.grammar is not None

    def apply(self, logits: torch.Tensor, positions: torch.Tensor | int,
              contexts: list[list[int]] | None = None) -> torch.Tensor:
        """logits [n, V] of rows predicting output positions `positions` ([n] or one int), each after the
        output tokens contexts[i] (needed where `reads_context`) -> a new [n, V] with the rules applied
        (the same float ops on each row, whatever n or the rows beside it)."""
        out = logits.float().clone()
        if self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0:
            for row, context in zip(out, contexts):
                self._penalise(row, context)
        if self.bias_ids.numel():
            out[:, self.bias_ids] += self.bias.to(out.device)
        if self.min_tokens and self.stop_ids.numel():
            if isinstance(positions, int):
                positions = torch.full((out.shape[0],), positions, device=out.device)
            early = (positions.to(out.device) < self.min_tokens).nonzero().flatten()  # [e] rows
            if early.numel():
                out[early[:, None], self.stop_ids.to(out.device)[None, :]] = float("-inf")
        if self.grammar is not None:  # contexts[i]: the output before row i, its committed part first
            self.grammar.mask(out, [c[self.grammar.committed:] for c in contexts])
        return out

    def _penalise(self, row: torch.Tensor, context: list[int]) -> None:
        """row [V] in place: repetition over prompt and output ids, then frequency and presence."""
        counts = Counter(context)
        if self.repetition != 1.0:
            seen = torch.tensor(sorted(self.prompt | counts.keys()), dtype=torch.long, device=row.device)
            x = row[seen]
            row[seen] = torch.where(x > 0, x / self.repetition, x * self.repetition)
        if (self.frequency or self.presence) and counts:
            ids = torch.tensor(sorted(counts), dtype=torch.long, device=row.device)
            n = torch.tensor([counts[i] for i in sorted(counts)], dtype=torch.float32, device=row.device)
            row[ids] -= n * self.frequency + self.presence
