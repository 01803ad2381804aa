"""The rows a request's steps recycled that its draft session has not taken yet, handed over: by the
step that drafts a tree from them, every few plain steps, or at the end (engine thread only); and the
end of a request's draft session (`end_session`)."""

from __future__ import annotations

import logging

import torch

from ..sequence import Sequence
from ..tr.recycle import RecycledRows, latest_rows

log = logging.getLogger("trserve.engine")


def end_session(seq: Sequence, whole: bool) -> None:
    """`seq`'s draft session ends: a finished request (`whole`) adds its prompt and output to its
    tenant's history and hands over its last rows; a failed one hands over nothing. Neither can fail
    the request: its output is whole (history and rows are optimisations), or its caller hears of its
    own failure."""
    if seq.drafting.session is None:
        return
    if whole and seq.generated:
        try:
            seq.drafting.session.remember(list(seq.prepared.ids) + seq.generated)
        except Exception:  # noqa: BLE001
            log.exception("adding a request to its tenant's history failed")
    try:
        seq.drafting.session.close(pending(seq) if whole else None)
    except Exception:  # noqa: BLE001
        log.exception("closing a request's draft session failed; its last rows are not recycled")


def pending(seq: Sequence) -> RecycledRows | None:
    """Takes the rows `seq` has not handed to its session yet: its last tree step's, then its plain
    steps' (for a token in both, the later row wins); `seq` holds none afterwards."""
    last, plain = seq.drafting.take_rows()
    if not plain:
        return last
    topk = torch.stack([r for _, r, _ in plain])  # [m, K]
    probs = torch.stack([p for _, _, p in plain])  # [m, K]
    tokens = torch.tensor([t for t, _, _ in plain], dtype=torch.long, device=topk.device)  # [m]
    if last is not None:  # engine rows always carry confidences (engine/tr/recycle.py)
        tokens, topk, probs = (torch.cat(pair) for pair in ((last.tokens, tokens), (last.topk, topk), (last.probs, probs)))
    return latest_rows(tokens, topk, probs)
