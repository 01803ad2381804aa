"""The Decoder on the real SmolLM2 model: stops, streaming, hot start, bad input."""

import time

import pytest
import torch

from trserve.core.errors import FingerprintMismatch, NotFound
from trserve.core.model_spec import ModelSpec
from trserve.engine import AdjacencyMatrix, GenerationRequest, InvalidArgument
from trserve.engine.results import GenerationResult, StepChunk

CHAT = [{"role": "user", "content": "List the planets of the solar system in order, one per line."}]


def test_tr_equals_own_autoregressive_mode(decoder):
    story = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    ar = decoder.generate(messages=story, max_new_tokens=48, mode="ar")
    tr = decoder.generate(messages=story, max_new_tokens=48, mode="tr")
    assert tr.ids == ar.ids and tr.text == ar.text
    assert ar.stats.steps == len(ar.ids) - 1 and ar.stats.draft_mode == "none"
    assert tr.stats.steps < ar.stats.steps  # some drafts were accepted even from a cold matrix
    assert tr.stats.mat == pytest.approx((len(tr.ids) - 1) / tr.stats.steps)
    assert tr.finish_reason == "length" and len(tr.ids) == 48


def test_stream_chunks_add_up_to_the_result(decoder):
    items = list(decoder.stream(GenerationRequest(messages=CHAT, max_new_tokens=40)))
    chunks = [i for i in items if isinstance(i, StepChunk)]
    result = items[-1]
    assert isinstance(result, GenerationResult)
    assert [t for c in chunks for t in c.tokens] == result.ids
    assert "".join(c.text for c in chunks) == result.text


def test_stop_string_and_stop_ids(decoder):
    full = decoder.generate(messages=CHAT, max_new_tokens=40)
    word = "Venus"
    assert word in full.text
    cut = decoder.generate(messages=CHAT, max_new_tokens=40, stop_strings=[word])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(word)]
    assert full.ids[: len(cut.ids)] == cut.ids
    stop_id = full.ids[5]
    by_id = decoder.generate(messages=CHAT, max_new_tokens=40, stop_token_ids=[stop_id])
    assert by_id.finish_reason == "eos" and by_id.ids == full.ids[: full.ids.index(stop_id) + 1]


def test_eos_finishes(decoder):
    r = decoder.generate(messages=[{"role": "user", "content": "Say just the word yes."}], max_new_tokens=60)
    assert r.finish_reason == "eos" and r.ids[-1] in decoder.eos_ids and len(r.ids) < 60


def test_cancel_and_deadline(decoder):
    calls = []
    r = decoder.generate(messages=CHAT, max_new_tokens=100, cancelled=lambda: calls.append(1) or len(calls) > 2)
    assert r.finish_reason == "cancelled" and r.stats.steps == 2
    r = decoder.generate(messages=CHAT, max_new_tokens=100, deadline=0.0)
    assert r.finish_reason == "time_limit" and r.ids == []  # past its deadline before it left the queue
    r = decoder.generate(messages=CHAT, max_new_tokens=1000, ignore_eos=True, deadline=time.monotonic() + 0.5)
    assert r.finish_reason == "time_limit" and 0 < len(r.ids) < 1000


def test_hot_start_raises_mat(decoder):
    """A second, similar request drafts better from the carried matrix than from zeros."""
    first = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    second = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]
    hot = decoder.new_matrix()
    decoder.generate(messages=first, max_new_tokens=96, matrix=hot)
    assert hot.version > 0 and hot.nonzero_rows() > 40
    warm = decoder.generate(messages=second, max_new_tokens=96, matrix=hot)
    cold = decoder.generate(messages=second, max_new_tokens=96, matrix=decoder.new_matrix())
    assert warm.ids == cold.ids  # lossless either way
    assert warm.stats.mat > cold.stats.mat
    assert warm.stats.matrix_version == hot.version


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "   "}, "empty"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1, 49152]}, "outside the vocabulary"),
        ({"input_ids": [-1]}, "outside the vocabulary"),
        ({"prompt": "hi", "max_new_tokens": 0}, "positive"),
        ({"prompt": "hi", "max_new_tokens": -3}, "positive"),
        ({"prompt": "hi", "max_new_tokens": 10**6}, "exceeds the model context"),
        ({"prompt": "hi", "input_ids": [1]}, "exactly one"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"messages": []}, "non-empty"),
        ({"prompt": "hi", "stop_token_ids": [10**6]}, "outside the vocabulary"),
        ({"prompt": "hi", "mode": "fast"}, "mode"),
    ],
)
def test_bad_input_is_a_clear_value_error(decoder, kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        decoder.generate(**kwargs)


def test_unknown_tree_and_bad_matrix(decoder):
    with pytest.raises(NotFound, match="unknown tree"):
        decoder.generate(prompt="hi", tree="no-such-tree")
    other = AdjacencyMatrix(ModelSpec("another-model", decoder.vocab_size, 8))
    with pytest.raises(FingerprintMismatch, match="fingerprint"):
        decoder.generate(prompt="hi", matrix=other)
    with pytest.raises(ValueError, match="shape"):
        AdjacencyMatrix(decoder.spec, rows=torch.zeros(10, 8, dtype=torch.int32))
    small_k = AdjacencyMatrix(ModelSpec(decoder.fingerprint, decoder.vocab_size, 4))
    with pytest.raises(ValueError, match="K=4"):
        decoder.generate(prompt="hi", matrix=small_k)


def test_fingerprint_is_stable_and_model_specific(decoder, loaded_smollm2):
    from trserve.engine.model.loader import model_fingerprint
    from tests.conftest import tiny_llama

    assert decoder.fingerprint == model_fingerprint(decoder.tokenizer, decoder.model.config)
    assert model_fingerprint(decoder.tokenizer, tiny_llama(vocab_size=49152).config) != decoder.fingerprint


def test_prompt_seeding_writes_the_prompts_rows(decoder):
    from trserve.engine import Decoder, DecoderConfig

    ids = decoder.prompts.chat_ids(CHAT)
    seeded = decoder.new_matrix()
    fresh = Decoder(DecoderConfig(), loaded=decoder.loaded)  # seeding scales with the share of steps that
    fresh.generate(input_ids=ids, max_new_tokens=1, matrix=seeded)  # verified trees: a new engine's is 1
    # one prefill, one batch of rows: every distinct prompt token (within the seed window) got a row
    assert seeded.version == 1
    assert set(torch.nonzero(seeded.rows.any(dim=1)).flatten().tolist()) == set(ids)
    plain = Decoder(DecoderConfig(seed_from_prompt=0), loaded=decoder.loaded)
    unseeded = plain.new_matrix()
    plain.generate(input_ids=ids, max_new_tokens=1, matrix=unseeded)
    assert unseeded.version == 0 and unseeded.nonzero_rows() == 0


def test_tree_ranks_must_fit_the_matrix(decoder):
    """A node of rank r reads successor r of its parent's row: with K=4 the paper tree (ranks up to
    7) is refused up front instead of failing inside a step."""
    from trserve.engine import Decoder, DecoderConfig

    with pytest.raises(InvalidArgument, match="rank 7 but the matrix keeps K=4"):
        Decoder(DecoderConfig(k=4, tree="paper"), loaded=decoder.loaded)
    small = Decoder(DecoderConfig(k=4, tree="cpu-4"), loaded=decoder.loaded)
    with pytest.raises(InvalidArgument, match="K=4"):
        small.generate(prompt="hi", tree="paper", max_new_tokens=2)
