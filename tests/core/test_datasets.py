"""The bundled prompt sets: the repetitive workload parses and has the shape the bench relies on."""

import json

import pytest

from trserve.core.datasets import PROMPT_SETS, prompt_file

TWO_TURNS = {"code-edit", "agent"}  # turn 2 re-asks for / re-sends what turn 1 produced


def test_repetitive_workload_parses_with_enough_questions_per_category():
    assert "repetitive" in PROMPT_SETS
    rows = [json.loads(line) for line in prompt_file("repetitive").read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[dict]] = {}
    for q in rows:
        assert set(q) == {"question_id", "category", "turns"}
        assert isinstance(q["question_id"], int)
        assert q["turns"] and all(isinstance(t, str) and t.strip() for t in q["turns"])
        by_cat.setdefault(q["category"], []).append(q)
    assert len({q["question_id"] for q in rows}) == len(rows)
    assert {"code-edit", "extraction", "agent"} <= set(by_cat)
    assert all(len(qs) >= 4 for qs in by_cat.values())
    for cat in TWO_TURNS:
        assert all(len(q["turns"]) == 2 for q in by_cat[cat])
    # one instruction template over different records: every extraction prompt starts the same way
    heads = {q["turns"][0].split("Record:")[0] for q in by_cat["extraction"]}
    assert len(heads) == 1 and len({q["turns"][0] for q in by_cat["extraction"]}) == len(by_cat["extraction"])
    # an agent's second turn pastes its first tool output again
    for q in by_cat["agent"]:
        first_output = q["turns"][0].split("Tool output of")[1]
        assert first_output in q["turns"][1]


def test_unknown_prompt_set_is_refused():
    with pytest.raises(ValueError, match="bundled"):
        prompt_file("nope")
