"""Logit rules a request may add before each choice: `logit_bias` (a fixed amount added to chosen ids'
logits, OpenAI's) and `min_tokens` (vLLM's: no stop id before that many tokens).

Both depend only on the row and the output position the row predicts, never on the tree around it,
so a tree node's choice under the rules is exactly the choice plain decoding makes at that position:
TR stays lossless with them. (Penalties depending on the tokens before, presence / frequency /
repetition, would need each node's path; they are not built.) Raw logits still feed recycling."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitRules:
    bias_ids: torch.Tensor  # [b] int64
    bias: torch.Tensor  # [b] float32, added to those ids' logits
    stop_ids: torch.Tensor  # [s] int64, banned (-inf) at output positions < min_tokens
    min_tokens: int

    @classmethod
    def of(cls, logit_bias: tuple[tuple[int, float], ...], min_tokens: int, stop_ids, device) -> LogitRules | None:
        """The rules of a request, or None where it has none (the fast path: raw argmax)."""
        if not logit_bias and not (min_tokens and stop_ids):
            return None
        ids = torch.tensor([i for i, _ in logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in logit_bias], dtype=torch.float32, device=device)
        stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        return cls(ids, bias, stops, min_tokens)

    def apply(self, logits: torch.Tensor, positions: torch.Tensor | int) -> torch.Tensor:
        """logits [n, V] of rows predicting output positions `positions` ([n] or one int) -> a new
        [n, V] with the rules applied (the same float ops on each row, whatever n)."""
        out = logits.float().clone()
        if self.bias_ids.numel():
            out[:, self.bias_ids] += self.bias.to(out.device)
        if self.min_tokens and self.stop_ids.numel():
            if isinstance(positions, int):
                positions = torch.full((out.shape[0],), positions, device=out.device)
            early = (positions.to(out.device) < self.min_tokens).nonzero().flatten()  # [e] rows
            if early.numel():
                out[early[:, None], self.stop_ids.to(out.device)[None, :]] = float("-inf")
        return out
