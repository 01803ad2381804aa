"""Prompt seeding: a TR request's matrix learns from the model's own predictions at its prompt's last
positions while the prompt is prefilled (`DecoderConfig.seed_from_prompt` positions, scaled by the
share of steps that verify trees), so its first trees already draft from its own context. Only the
positions whose row the tenant's matrix lacks and whose token does not recur later in that tail seed
it (tr/recycle.py:seed_positions); each costs an LM-head row in the prefill. The rows reach the
request's session with its first tree step.

Example: a 40-token prompt, 32 positions to seed, 10 tokens from a cached prefix: positions 10..39
are looked at (not the cached ones), say 12, 15 and 39 seed; a 16-token chunk [16, 32) takes none,
the last chunk [32, 40) takes 39 (chunk row 7), its top-K and their confidences."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .recycle import RecycledRows, latest_rows, seed_positions, top_ids


@dataclass
class PromptSeeding:
    at: list[int]  # the prompt positions whose predictions seed the matrix, ascending
    n: int = 0  # the prompt's last positions that could (seed_from_prompt scaled by the tree share)
    parts: list = field(default_factory=list)  # (tokens [c], topk [c, K], probs [c, K]) per chunk that had some

    @classmethod
    def plan(cls, ids: list[int], done: int, n: int, known_rows: Callable[[list[int]], list[bool]]) -> PromptSeeding:
        """Of the prompt's last `n` positions, those after `done` (a cached prefix) that seed."""
        first = max(done, len(ids) - n)
        tail = list(ids[first:])
        return cls([first + i for i in seed_positions(tail, known_rows(tail))], n)

    def in_chunk(self, done: int, c: int) -> list[int]:
        """The seeding positions in the chunk [done, done + c), relative to it."""
        return [q - done for q in self.at if done <= q < done + c]

    def take(self, tokens: torch.Tensor, logits: torch.Tensor, known: torch.Tensor | None, k: int, probs_of) -> None:
        """tokens [s] at those positions, their logits [s, V] (`known`: their top-K ids [s, K] where the
        forward computed them) -> their rows."""
        top = top_ids(logits, k, known)  # [s, K]
        self.parts.append((tokens, top, probs_of(logits, top)))

    def take_rows(self) -> RecycledRows | None:
        """Every seeded position's row (a token's latest), or None where none seeded; the parts go."""
        parts, self.parts = self.parts, []
        return latest_rows(*(torch.cat(part) for part in zip(*parts))) if parts else None
