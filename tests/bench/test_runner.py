"""The bench's question selection: the hot-start warm set never overlaps the measured set."""

import pytest

from trserve.bench.cli import DEFAULT_PROMPTS
from trserve.bench.runner import BenchConfig, select_questions


def test_warm_questions_follow_the_measured_ones_and_never_overlap():
    measured = select_questions(DEFAULT_PROMPTS, 2)
    warm = select_questions(DEFAULT_PROMPTS, 3, skip=2)
    ids = {q["question_id"] for q in measured}
    assert not ids & {q["question_id"] for q in warm}
    cats = {q["category"] for q in measured}
    assert {q["category"] for q in warm} == cats  # every category has more than 2 questions
    assert len(measured) == 2 * len(cats) and len(warm) == 3 * len(cats)
    # in file order: per category the warm ones are the next three
    both = select_questions(DEFAULT_PROMPTS, 5)
    for cat in cats:
        ordered = [q["question_id"] for q in both if q["category"] == cat]
        assert [q["question_id"] for q in warm if q["category"] == cat] == ordered[2:5]


def test_negative_warm_count_is_refused():
    with pytest.raises(ValueError, match="warm_per_category"):
        BenchConfig(prompts=DEFAULT_PROMPTS, warm_per_category=-1)
