"""OpenAI JSON -> GenerateRequest and errors -> HTTP, without a model."""

from __future__ import annotations

import pytest

from trserve.core.errors import InvalidArgument, PermissionDenied, Unavailable
from trserve.engine.results import GenerationResult, GenerationStats
from trserve.services.openai.app import Unauthenticated, error_body
from trserve.services.openai.convert import BadParam, ModelNotFound, completion, parse_request
from trserve.services.worker.admission import QueueFull
from trserve.services.worker.config import Limits
from trserve.services.worker.checks import check_call

MODEL = "smollm2-135m-instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def test_a_chat_request_becomes_the_ask_the_front_door_checks():
    req = parse_request({**CHAT, "max_completion_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 3,
                         "stop": "\n", "stream": True, "stream_options": {"include_usage": True}}, "chat", MODEL, "alice")
    assert req.stream and req.include_usage and req.ask.tenant == "alice"
    call = check_call(req.ask, Limits(), "default")
    r = call.request
    assert r.messages == [{"role": "user", "content": "Hi"}] and r.max_new_tokens == 12 and r.stop_strings == ("\n",)
    assert r.sampling.temperature == pytest.approx(0.7) and r.sampling.top_p == pytest.approx(0.9) and r.sampling.seed == 3
    greedy = check_call(parse_request(CHAT, "chat", MODEL, "default").ask, Limits(), "default")
    assert greedy.request.sampling is None and greedy.request.max_new_tokens == Limits().default_max_new_tokens


def test_min_p_reaches_the_engine_request_and_bad_values_are_a_400_naming_it():
    """vLLM's min_p, on both routes; out of [0, 1] or not a number: 400 naming min_p (the engine's own
    range check says the same over gRPC)."""
    for route, body in (("chat", CHAT), ("text", {"model": MODEL, "prompt": "hi"})):
        req = parse_request({**body, "temperature": 0.7, "min_p": 0.05}, route, MODEL, "t").ask
        sampling = check_call(req, Limits(), "default").request.sampling
        assert sampling.min_p == pytest.approx(0.05) and sampling.top_p == 1.0
    off = check_call(parse_request({**CHAT, "temperature": 0.7}, "chat", MODEL, "t").ask, Limits(), "default")
    assert off.request.sampling.min_p == 0.0
    for value in (-0.1, 1.5, "0.1", True):
        with pytest.raises(BadParam) as bad:
            parse_request({**CHAT, "temperature": 0.7, "min_p": value}, "chat", MODEL, "t")
        status, error, _ = error_body(bad.value)
        assert bad.value.param == "min_p" and status == 400 and "min_p" in error["error"]["message"], error


def test_prompts_of_a_completion():
    assert parse_request({"model": MODEL, "prompt": ["Once"]}, "text", MODEL, "t").ask.options["prompt"] == "Once"
    assert list(parse_request({"model": MODEL, "prompt": [1, 2]}, "text", MODEL, "t").ask.options["input_ids"]) == [1, 2]
    with pytest.raises(BadParam) as e:
        parse_request({"model": MODEL, "prompt": ["a", "b"]}, "text", MODEL, "t")
    assert e.value.param == "prompt"


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "n": 17}, "n"), ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "temperature": 3}, "temperature"), ({**CHAT, "stop": [1]}, "stop"),
    ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"), ({"messages": CHAT["messages"]}, "model"),
])
def test_bad_requests_name_their_parameter(body, param):
    with pytest.raises(BadParam) as e:
        parse_request(body, "chat", MODEL, "t")
    assert e.value.param == param
    assert error_body(e.value)[0] == 400


@pytest.mark.parametrize("body, tenant, param", [
    ({**CHAT, "max_tokens": 0}, None, "max_tokens"), ({**CHAT, "max_completion_tokens": 10**6}, None, "max_tokens"),
    ({**CHAT, "max_tokens": "8"}, None, "max_tokens"), (CHAT, "bad tenant!", "X-Tenant"),
])
def test_the_front_door_checks_max_tokens_and_the_tenant(body, tenant, param):
    """Parsed as given; refused by the front door's one check (the same message as over gRPC), which
    the HTTP error names by OpenAI's parameter."""
    ask = parse_request(body, "chat", MODEL, tenant).ask
    with pytest.raises(InvalidArgument) as refused:
        check_call(ask, Limits(max_new_tokens_cap=256), "default")
    status, error, _ = error_body(refused.value)
    assert status == 400 and error["error"]["param"] == param


def test_errors_map_like_grpc_statuses():
    status, body, _ = error_body(ModelNotFound("no such model", "model"))
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    status, body, headers = error_body(QueueFull("busy", retry_after_s=2.2))
    assert status == 429 and headers == {"Retry-After": "3", "retry-after-ms": "2200"}
    assert [error_body(e)[0] for e in (Unauthenticated("x"), PermissionDenied("x"), Unavailable("x"),
                                       InvalidArgument("x"), RuntimeError("secret"))] == [401, 403, 503, 400, 500]
    assert "secret" not in error_body(RuntimeError("secret"))[1]["error"]["message"]


def test_usage_sums_draft_sources():
    stats = GenerationStats(prompt_tokens=5, generated_tokens=7, steps=3, accepted_per_step=[3, 2, 2], mat=7 / 3,
                            prefill_s=0.1, decode_s=0.2, tokens_per_s=20, matrix_version=3, matrix_epoch=1,
                            draft_mode="embedded", tree="dynamic", drafted={"matrix": 6, "context": 4},
                            accepted={"matrix": 2, "context": 2}, cached_tokens=3)
    result = GenerationResult(ids=[1, 2, 3, 4, 5, 6, 7], text="hello", finish_reason="eos", stats=stats)
    out = completion(parse_request(CHAT, "chat", MODEL, "t"), result, 0.0, "fp", str, "t")
    assert out["choices"][0] == {"index": 0, "finish_reason": "stop", "logprobs": None,
                                 "message": {"role": "assistant", "content": "hello"}}
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 3},
                            "completion_tokens_details": {"accepted_prediction_tokens": 4,
                                                          "rejected_prediction_tokens": 6}}
    assert out["trserve"]["draft_sources"] == {"context": {"drafted": 4, "accepted": 2},
                                               "matrix": {"drafted": 6, "accepted": 2}}
    assert out["trserve"]["mat"] == pytest.approx(7 / 3)


@pytest.mark.parametrize("field, value", [
    ("guided_whitespace_pattern", " "),
    ("use_beam_search", True), ("bad_words", ["x"]), ("skip_special_tokens", False), ("prompt_logprobs", 1),
])
def test_vllms_output_changing_fields_are_refused_not_ignored(field, value):
    """Issue 44: vLLM's spellings came back 200 with the field ignored (unconstrained text where a caller
    asked for JSON). Each is refused with 400 naming it until it is built; its default value passes."""
    with pytest.raises(BadParam) as refused:
        parse_request({**CHAT, field: value}, "chat", MODEL, "t")
    assert refused.value.param == field and "not supported" in str(refused.value)
    defaults = {"use_beam_search": False,
                "skip_special_tokens": True}
    if field in defaults:
        parse_request({**CHAT, field: defaults[field]}, "chat", MODEL, "t")


@pytest.mark.parametrize("fields, kind, value", [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                  "schema": {"type": "object"}}}},
     "json_schema", '{"type": "object"}'),
    ({"guided_json": {"type": "integer"}}, "json_schema", '{"type": "integer"}'),
    ({"guided_json": '{"type": "integer"}'}, "json_schema", '{"type": "integer"}'),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
    ({"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar"}, "grammar", 'root ::= "a"'),
    ({"structured_outputs": {"choice": ["x"]}}, "choice", ["x"]),
    ({"structured_outputs": {"json": {"type": "object"}}}, "json_schema", '{"type": "object"}'),
])
def test_structured_output_spellings_reach_the_engine_request(fields, kind, value):
    """Issue 44, item 1: OpenAI's response_format and vLLM's guided_* / structured_outputs, each onto
    the engine's StructuredOutput."""
    for route, body in (("chat", CHAT), ("text", {"model": MODEL, "prompt": "hi"})):
        req = parse_request({**body, **fields}, route, MODEL, "t").ask
        so = check_call(req, Limits(), "default").request.structured
        assert so.kind == kind and (so.choices == tuple(value) if kind == "choice" else
                                    kind == "json_object" or so.spec == value)
    plain = parse_request({**CHAT, "response_format": {"type": "text"}}, "chat", MODEL, "t").ask
    assert plain.options.get("structured") is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format"),
    ({"guided_choice": "a"}, "guided_choice"), ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
])
def test_bad_structured_output_is_a_400_naming_the_field(fields, param):
    with pytest.raises(BadParam) as bad:
        parse_request({**CHAT, **fields}, "chat", MODEL, "t")
    assert bad.value.param == param


def test_vllms_ignore_eos_and_stop_token_ids_are_applied():
    req = parse_request({**CHAT, "ignore_eos": True, "stop_token_ids": [7, 9]}, "chat", MODEL, "t").ask
    call = check_call(req, Limits(), "default")
    assert call.request.ignore_eos and call.request.stop_token_ids == (7, 9)
    for bad in ({"ignore_eos": "yes"}, {"stop_token_ids": ["7"]}):
        with pytest.raises(BadParam):
            parse_request({**CHAT, **bad}, "chat", MODEL, "t")


def test_logit_bias_and_min_tokens_reach_the_engine_request():
    """Issue 44, item 5 (in part): OpenAI's logit_bias and vLLM's min_tokens, applied losslessly."""
    req = parse_request({**CHAT, "logit_bias": {"7": -100, "9": 2.5}, "min_tokens": 3, "max_tokens": 8}, "chat",
                        MODEL, "t").ask
    r = check_call(req, Limits(), "default").request
    assert r.logit_bias == ((7, -100.0), (9, 2.5)) and r.min_tokens == 3
    for bad in ({"logit_bias": {"x": 1}}, {"logit_bias": {"7": 101}}, {"logit_bias": [1]}, {"min_tokens": -1}):
        with pytest.raises(BadParam):
            parse_request({**CHAT, **bad}, "chat", MODEL, "t")
    with pytest.raises(InvalidArgument, match="min_tokens"):  # more than max_tokens: the engine's own check
        check_call(parse_request({**CHAT, "min_tokens": 9, "max_tokens": 8}, "chat", MODEL, "t").ask,
                   Limits(), "default")


def test_penalties_reach_the_engine_request():
    req = parse_request({**CHAT, "frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.2},
                        "chat", MODEL, "t").ask
    r = check_call(req, Limits(), "default").request
    assert (r.frequency_penalty, r.presence_penalty) == (0.5, -0.25) and r.repetition_penalty == pytest.approx(1.2)
    off = check_call(parse_request(CHAT, "chat", MODEL, "t").ask, Limits(), "default").request
    assert (off.repetition_penalty, off.frequency_penalty, off.presence_penalty) == (1.0, 0.0, 0.0)
    for bad in ({"frequency_penalty": 3}, {"presence_penalty": "x"}, {"repetition_penalty": 0}):
        with pytest.raises(BadParam) as refused:
            parse_request({**CHAT, **bad}, "chat", MODEL, "t")
        assert refused.value.param == next(iter(bad))


def test_the_field_table_is_what_the_server_does():
    """docs/openai.md: every refused field is a 400 naming it for a non-default value, every ignored one
    passes, and every field the parser refuses is in the table."""
    from pathlib import Path

    from trserve.services.openai.convert import UNSUPPORTED

    rows = [line.split("|")[1:5] for line in (Path(__file__).resolve().parents[3] / "docs" / "openai.md")
            .read_text().splitlines() if line.startswith("| `")]
    table = {name.strip().strip("`"): (on.strip(), status.strip()) for name, on, status, _ in rows}
    assert set(UNSUPPORTED) <= {n for n, (_, s) in table.items() if s == "refused"}
    for name, (on, status) in table.items():
        kind, body = ("text", {"model": MODEL, "prompt": "hi"}) if on == "text" else ("chat", CHAT)
        if status == "refused":
            with pytest.raises(BadParam) as refused:
                parse_request({**body, name: {"x": 1}}, kind, MODEL, "t")
            assert refused.value.param == name
        elif status == "ignored":
            assert parse_request({**body, name: "low"}, kind, MODEL, "t").ask == \
                parse_request(body, kind, MODEL, "t").ask
