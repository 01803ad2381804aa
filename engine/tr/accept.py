"""Greedy acceptance of the longest matching tree path, plus the bonus token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import CompiledTree


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # node indices root..deepest accepted node (root always included)
    tokens: list[int]  # newly committed tokens: the accepted drafted tokens then the bonus token

    @property
    def accepted(self) -> int:
        """Tokens committed this step (drafted matches + 1 bonus)."""
        return len(self.tokens)


def accept_greedy(tokens: torch.Tensor, greedy: torch.Tensor, tree: CompiledTree) -> Acceptance:
    """Deepest node whose whole root path matches the model's greedy choices.

    tokens: [n] drafted tokens (root first); greedy: [n] argmax of the logits at each node.
    Node i matches when tokens[i] == greedy[parent[i]]; it is accepted when it and all its
    ancestors match. Among accepted nodes the deepest wins, ties to the lowest index (= the
    higher-ranked path). The bonus token is greedy[winner]: what plain greedy decoding would emit next.
    Example: tokens [5, 7, 9, 3], greedy [7, 3, 1, 8], paths [[0], [1], [0, 0]]:
    node 1 (7) matches greedy[0]=7, node 3 (3) matches greedy[1]=3 -> path [0, 1, 3], tokens [7, 3, 8].
    """
    if tokens.device.type == "cpu":  # host tensors: the same rule on Python ints (no tensor op per rule)
        return _accept_host(tokens.tolist(), greedy.tolist(), tree)
    return _accept_tensor(tokens, greedy, tree)


def _accept_tensor(tokens: torch.Tensor, greedy: torch.Tensor, tree: CompiledTree) -> Acceptance:
    """accept_greedy on the device: a few tensor ops and one host read of the winner."""
    ok = tokens == greedy[tree.parent]  # [n]
    ok[0] = True
    # A node is accepted when every node on its root path matches: gather along path_nodes
    # (padded with -1 -> an always-true slot), so node order does not matter (lookup chains are
    # appended after the breadth-first nodes).
    ok_pad = torch.cat([ok, ok.new_ones(1)])  # [n + 1]
    accepted = ok_pad[tree.path_nodes].all(dim=1)  # [n]
    score = torch.where(accepted, tree.depth, -1)  # [n]
    winner = int(torch.argmax(score))  # first maximum -> lowest index at the deepest level
    path = tree.path_to(winner)
    committed = tokens[path[1:]].tolist() + [int(greedy[winner])]
    return Acceptance(path=path, tokens=committed)


def _accept_host(tok: list[int], greedy: list[int], tree: CompiledTree) -> Acceptance:
    """accept_greedy for tensors in host memory: what the tensor rule computes, on lists (a handful of
    torch ops on a few dozen nodes cost more than the loop). The tests check both on random trees."""
    parent = tree.host_parent
    ok = [True] + [tok[i] == greedy[parent[i]] for i in range(1, len(tok))]
    winner, deepest = 0, 0
    for i, path in enumerate(tree.host_paths):  # first maximum -> lowest index at the deepest level
        if len(path) - 1 > deepest and all(ok[j] for j in path):
            winner, deepest = i, len(path) - 1
    path = list(tree.host_paths[winner])
    return Acceptance(path=path, tokens=[tok[j] for j in path[1:]] + [greedy[winner]])
