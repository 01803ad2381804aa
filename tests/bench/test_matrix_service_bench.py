"""The matrix-service bench's conversations: a bundled workload's, every turn, per category; or the
built-in single-turn prompts."""

from __future__ import annotations

from trserve.bench.matrix_service import PROMPTS, conversations


def test_a_workloads_conversations_keep_every_turn_and_their_category():
    convs = conversations("repetitive", 2, prompts=0)
    categories = [c for c, _ in convs]
    assert sorted(set(categories)) == ["agent", "code-edit", "extraction"]
    assert all(categories.count(c) == 2 for c in set(categories))
    assert all(all(isinstance(t, str) and t for t in turns) for _, turns in convs)
    # code-edit and agent conversations have a second turn; extraction's records are one turn each
    assert {c: len(turns) for c, turns in convs} == {"code-edit": 2, "agent": 2, "extraction": 1}


def test_without_a_workload_the_first_prompts_one_turn_each():
    assert conversations(None, 1, prompts=2) == [("", [PROMPTS[0]]), ("", [PROMPTS[1]])]
    assert conversations(None, 1, prompts=0) == []
