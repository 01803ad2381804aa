"""The rows a request's steps recycled that its draft session has not taken yet, handed over: by the
step that drafts a tree from them, every few plain steps, or at the end (engine thread only)."""

from __future__ import annotations

import torch

from trserve.engine.sequence import Sequence
from trserve.engine.tr.recycle import RecycledRows, latest_rows


def pending(live: Sequence) -> RecycledRows | None:
    """Takes the rows `live` has not handed to its session yet: its last tree step's, then its plain
    steps' (for a token in both, the later row wins); `live` holds none afterwards."""
    last, plain = live.recycled, live.plain
    live.recycled, live.plain = None, []
    if not plain:
        return last
    topk = torch.stack([r for _, r, _ in plain])  # [m, K]
    probs = torch.stack([p for _, _, p in plain])  # [m, K]
    tokens = torch.tensor([t for t, _, _ in plain], dtype=torch.long, device=topk.device)  # [m]
    if last is not None:  # engine rows always carry confidences (engine/tr/recycle.py)
        tokens, topk, probs = (torch.cat(pair) for pair in ((last.tokens, tokens), (last.topk, topk), (last.probs, probs)))
    return latest_rows(tokens, topk, probs)
