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


def test_decoders_sharing_an_engine_never_reuse_each_others_prompts(decoder):
    """`tr` and `tr-static` share one served engine: each is its own tenant there, so one's prompt is
    never prefilled for free from the other's prefix cache entry (which made `tr-static` look faster
    on long prompts), while a decoder's own next turn still reuses its own."""
    from trserve.bench.runner import _TR
    from trserve.engine.engine import BatchEngine, EngineConfig

    engine = BatchEngine(decoder, EngineConfig(max_batch=1))
    first, second = (_TR(decoder, engine, "tr", tree, 0.0) for tree in (None, "cpu-hybrid"))
    first.tenant, second.tenant = "tr", "tr-static"
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(12))
    messages = [{"role": "user", "content": f"Summarise this text.\n{text}"}]
    ids, _ = first(messages, 4)
    _, stats = second(messages, 4)
    assert stats.cached_tokens == 0
    turn = [*messages, {"role": "assistant", "content": decoder.tokenizer.decode(ids)},
            {"role": "user", "content": "Shorter."}]
    _, own = first(turn, 4)
    assert own.cached_tokens > 0
