"""Recycling: every verified node's top-K becomes its token's row of the adjacency matrix."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .confidence import encode


@dataclass(frozen=True, repr=False)
class RecycledRows:
    """Rows to write into a matrix: `matrix[tokens[i]] = topk[i]` (and the confidences beside them,
    `probs[i]`: engine/tr/confidence.py), tokens unique. probs None: unknown (written as zeros)."""

    tokens: torch.Tensor  # [m] int64, unique
    topk: torch.Tensor  # [m, K] int32
    probs: torch.Tensor | None = None  # [m, K] uint8 confidence buckets, or None

    def __repr__(self) -> str:
        probs = "" if self.probs is None else ", probs"
        return f"RecycledRows(tokens={tuple(self.tokens.shape)}, topk={tuple(self.topk.shape)}{probs})"


def select_rows(tokens: torch.Tensor, accepted_path: list[int]) -> torch.Tensor:
    """Index of the one node per distinct token whose row is recycled.

    tokens: [n] node tokens; returns winners: [m] node indices, one per distinct token.
    Rule for a token present at several nodes: a node on the accepted path wins (its context is
    the real one), the deeper one if the path holds the token twice; otherwise the node verified
    first in breadth-first order (shallowest, then highest-ranked), whose context is closest to
    the real one. Example: tokens [5, 7, 7, 5], path [0, 2] -> winners for 5: node 0, for 7: node 2.
    """
    if tokens.device.type == "cpu":  # host tensors: the same rule on Python ints
        return torch.tensor(_select_host(tokens.tolist(), accepted_path), dtype=torch.long)
    return _select_tensor(tokens, accepted_path)


def distinct_rows(tokens: torch.Tensor, accepted_path: list[int]) -> torch.Tensor | None:
    """select_rows, or None when every node is its token's only one (then every row is kept as it is,
    with no gathers: an indexed copy of [m, V] logits cost ~0.13 ms at m = 4 right after a forward).
    Host tensors only answer None; device tensors always get their winners (no host sync)."""
    if tokens.device.type == "cpu" and len(set(tokens.tolist())) == tokens.shape[0]:
        return None
    return select_rows(tokens, accepted_path)


def _select_tensor(tokens: torch.Tensor, accepted_path: list[int]) -> torch.Tensor:
    """select_rows on the device: a sort by (token, priority), no host loop."""
    n = tokens.shape[0]
    priority = n - torch.arange(n, device=tokens.device)  # earlier nodes first: n..1
    on_path = torch.tensor(accepted_path, device=tokens.device)
    priority[on_path] = 2 * n + torch.arange(1, len(accepted_path) + 1, device=tokens.device)
    key = tokens * (4 * n) + priority  # sort by token, then priority ascending
    order = torch.argsort(key)
    sorted_tokens = tokens[order]
    last_of_group = torch.ones(n, dtype=torch.bool, device=tokens.device)
    last_of_group[:-1] = sorted_tokens[:-1] != sorted_tokens[1:]
    return order[last_of_group]


def _select_host(tokens: list[int], accepted_path: list[int]) -> list[int]:
    """select_rows on lists: winners in ascending token order, as the tensor rule returns them."""
    best: dict[int, int] = {}
    for i, t in enumerate(tokens):  # breadth-first order: a token's first node wins among the others
        best.setdefault(t, i)
    for i in accepted_path:  # path nodes win, the deeper one last
        best[tokens[i]] = i
    return [best[t] for t in sorted(best)]


def seed_positions(tokens: list[int], known: list[bool]) -> list[int]:
    """Which of a prompt's last positions seed the matrix (prompt seeding, engine/engine.py): the
    indices i of `tokens` whose row the tenant's matrix does not know yet (`known[i]` False) and whose
    token does not occur again later in `tokens` (the matrix keeps a token's latest row, so an earlier
    one would be overwritten unread). Each seeded position costs an LM-head row in the prefill.
    Example: tokens [5, 7, 5, 9], known [F, F, F, T] -> [1, 2] (5's last occurrence, and 7; 9 is known)."""
    later: set[int] = set()
    out = []
    for i in range(len(tokens) - 1, -1, -1):
        t = tokens[i]
        if t not in later and not known[i]:
            out.append(i)
        later.add(t)
    return out[::-1]


def top_ids(logits: torch.Tensor, k: int, known: torch.Tensor | None = None) -> torch.Tensor:
    """logits [m, V] -> their top-k ids [m, k] int32, largest first: `known` where the forward already
    computed them (the native forward's, ties by lower id), else torch.topk."""
    if known is not None and known.shape[-1] == k:
        return known
    return torch.topk(logits, k, dim=-1).indices.to(torch.int32)


def top_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits [m, V], ids [m, k] -> the softmax probabilities of those ids as uint8 buckets [m, k]
    (engine/tr/confidence.py): what the matrix keeps beside each id."""
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)  # [m, 1]
    return encode(torch.exp(logits.gather(-1, ids.long()).float() - lse))


def recycle_rows(tokens: torch.Tensor, logits: torch.Tensor, k: int, accepted_path: list[int],
                 topk: torch.Tensor | None = None, probs=None) -> RecycledRows:
    """tokens: [n], logits: [n, V] -> the deduplicated top-k rows of this verification, with their
    confidences. topk: [n, k] the nodes' top-k ids where the forward computed them; probs: their
    confidences [n, k] where the forward computed them too (with topk), or what computes them
    (default `top_probs`; the native forward has a C one)."""
    lg, rows = logits, topk
    known = probs if isinstance(probs, torch.Tensor) and topk is not None and topk.shape[-1] == k else None
    winners = distinct_rows(tokens, accepted_path)  # [m], or None: every node's row
    if winners is not None:
        tokens = torch.index_select(tokens, 0, winners)
        rows = torch.index_select(topk, 0, winners) if topk is not None else None  # [m, K]
        if known is not None:  # no logits needed (an indexed copy of [m, V] cost ~0.13 ms at m = 4)
            return RecycledRows(tokens=tokens, topk=rows, probs=torch.index_select(known, 0, winners))
        lg = torch.index_select(logits, 0, winners)  # [m, V]
    if known is not None:
        return RecycledRows(tokens=tokens, topk=rows, probs=known)
    if rows is None or rows.shape[-1] != k:  # the forward's top-k where it has one: no search over the vocabulary
        rows = top_ids(lg, k)
    compute = probs if callable(probs) else top_probs
    return RecycledRows(tokens=tokens, topk=rows, probs=compute(lg, rows))


def latest_rows(tokens: torch.Tensor, topk: torch.Tensor, probs: torch.Tensor) -> RecycledRows:
    """tokens [m], topk [m, K], probs [m, K] in step order -> one row per token: a repeated token's latest."""
    winners = distinct_rows(tokens, list(range(tokens.shape[0])))  # every row on the "path": the latest wins
    if winners is None:  # no token repeats (the usual case): no gathers
        return RecycledRows(tokens, topk, probs)
    return RecycledRows(*(torch.index_select(x, 0, winners) for x in (tokens, topk, probs)))


def root_rows(logits: list[torch.Tensor], tops: list[torch.Tensor | None], probs: list[torch.Tensor | None], k: int,
              probs_of=top_probs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(top-K ids [K], their confidences [K]) of the root (row 0) of each given plain step's logits
    [w, V]: the forward's own where it computed them (`tops`, `probs`: the native forward, in its pool
    while each row was in cache; a C call per row afterwards took ~35 us a row at B = 8), else the
    rows stacked and one call for all (`probs_of(logits [m, V], ids [m, K])`)."""
    if not logits:
        return []
    if probs[0] is not None and tops[0] is not None and tops[0].shape[-1] == k:
        return [(top[0], q[0]) for top, q in zip(tops, probs)]  # ([K], [K]) each
    lg = torch.cat([x[:1] for x in logits])  # [m, V]
    known = torch.cat([top[:1] for top in tops]) if tops[0] is not None else None
    ids = top_ids(lg, k, known)  # [m, K]
    return list(zip(ids, probs_of(lg, ids)))
