"""The engine's request type and the pieces of a request's text side, on tiny inputs."""

import pytest

from trserve.core.errors import InvalidArgument
from trserve.engine.request.prompt import check_token_ids
from trserve.engine.request.request import GenerationRequest
from trserve.engine.tr.sampling import SamplingParams


def test_request_checks_what_needs_no_model() -> None:
    r = GenerationRequest(prompt="hi", stop_strings=["x"], stop_token_ids=[3])
    assert r.stop_strings == ("x",) and r.stop_token_ids == (3,) and r.uses_default_tree
    assert not GenerationRequest(prompt="hi", tree="cpu-8").uses_default_tree
    assert not GenerationRequest(prompt="hi", mode="ar").uses_default_tree
    cases = [
        (dict(), "exactly one"),
        (dict(prompt="a", input_ids=[1]), "exactly one"),
        (dict(prompt="a", mode="fast"), "mode must be one of"),
        (dict(prompt="a", max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
        (dict(prompt="a", max_new_tokens=True), "max_new_tokens must be a positive integer"),
        (dict(prompt="a", stop_strings=["ok", ""]), "empty string"),
        (dict(prompt="a", sampling={"temperature": 1.0}), "SamplingParams"),
    ]
    for fields, match in cases:
        with pytest.raises(InvalidArgument, match=match):
            GenerationRequest(**fields)
    assert GenerationRequest(prompt="a", sampling=SamplingParams(temperature=0.5)).sampling.temperature == 0.5


def test_check_token_ids_names_what_is_wrong() -> None:
    assert check_token_ids((1, 2), 5) == [1, 2]
    with pytest.raises(InvalidArgument, match=r"stop token ids \[5, -1\] are outside the vocabulary \[0, 5\)"):
        check_token_ids([5, -1, 2], 5, "stop token ids")
    with pytest.raises(InvalidArgument, match="must be integers"):
        check_token_ids(["x"], 5)


def test_a_chat_template_that_refuses_messages_is_the_callers_error(decoder) -> None:
    """Strict templates (e.g. roles must alternate) raise; that is INVALID_ARGUMENT, not INTERNAL."""
    import copy

    from trserve.engine.request.prompt import PromptBuilder

    tokenizer = copy.deepcopy(decoder.tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.first %}"
                               "{{ raise_exception('the first message must not be the assistant') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    builder = PromptBuilder(tokenizer, decoder.vocab_size)
    assert builder.chat_ids([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidArgument, match="chat template refused these messages: the first message"):
        builder.chat_ids([{"role": "assistant", "content": "hi"}])
    with pytest.raises(InvalidArgument, match=r"temperature must be 0 \(greedy\) or in \[0.01"):
        SamplingParams(temperature=1e-39)
