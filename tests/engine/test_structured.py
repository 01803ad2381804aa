"""Structured output on the real model (issue 44, item 1): under a grammar, batched TR commits exactly
plain decoding's ids under the same grammar, greedy and seeded, with grammar-aware drafting on or
off; the answers follow their schemas; and drafting the forced tokens accepts more per step."""

from __future__ import annotations

import json

import pytest

from trserve.engine import GenerationRequest
from trserve.engine.engine import BatchEngine, EngineConfig
from trserve.engine.tr.grammar import StructuredOutput
from trserve.engine.tr.sampling import SamplingParams
from tests.conftest import load_prompts

TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def _follows(value, schema: dict) -> bool:
    """The schema keywords the bundled extraction schemas use: type, properties, required, items, enum."""
    kind = TYPES[schema["type"]]
    if not isinstance(value, kind) or (schema["type"] in ("integer", "number") and isinstance(value, bool)):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if schema["type"] == "object":
        props = schema.get("properties", {})
        return set(schema.get("required", ())) <= value.keys() <= props.keys() and \
            all(_follows(value[k], props[k]) for k in value)
    if schema["type"] == "array":
        return all(_follows(v, schema["items"]) for v in value)
    return True


def _requests(decoder) -> list[dict]:
    extraction = load_prompts("structured")
    chosen = [q for i, q in enumerate(extraction) if i % 6 < 2]  # 2 per schema
    out = [dict(messages=[{"role": "user", "content": q["turns"][0]}], max_new_tokens=128,
                structured=StructuredOutput("json_schema", json.dumps(q["schema"])), schema=q["schema"])
           for q in chosen]
    spec = load_prompts("spec_bench")
    out.append(dict(messages=[{"role": "user", "content": spec[0]["turns"][0]}], max_new_tokens=48,
                    structured=StructuredOutput("json_object")))
    out.append(dict(messages=[{"role": "user", "content": "Is Paris in France? Answer yes or no."}], max_new_tokens=8,
                    structured=StructuredOutput("choice", choices=("yes", "no", "not sure"))))
    out.append(dict(messages=[{"role": "user", "content": "Give a phone number."}], max_new_tokens=16,
                    structured=StructuredOutput("regex", r"\(\d{3}\) \d{3}-\d{4}")))
    return out


def _batched(decoder, requests: list[dict], **config) -> list:
    engine = BatchEngine(decoder, EngineConfig(max_batch=8, prefill_chunk=128, **config))
    matrix, outs = decoder.new_matrix(), [[] for _ in requests]
    for kwargs, out in zip(requests, outs):
        engine.submit(decoder.prepare(GenerationRequest(**kwargs)), out.append, matrix=matrix)
    with engine.stepping():
        while engine.running or engine.waiting or engine.prefilling:
            engine.step()
    return [out[-1] for out in outs]


@pytest.mark.slow
def test_tr_under_a_grammar_commits_plain_decodings_ids(decoder):
    requests = _requests(decoder)
    schemas = [r.pop("schema", None) for r in requests]
    sampled = [dict(r, sampling=SamplingParams(temperature=0.8, seed=11 + i)) for i, r in enumerate(requests[:4])]
    tr = _batched(decoder, requests + sampled)
    plain = _batched(decoder, requests, grammar_drafting=False)
    for kwargs, got in zip(requests + sampled, tr):
        ar = decoder.generate(GenerationRequest(**kwargs, mode="ar"))
        assert got.ids == ar.ids and got.finish_reason == ar.finish_reason
    assert [r.ids for r in plain] == [r.ids for r in tr[: len(requests)]]
    tok = decoder.tokenizer
    for schema, result in zip(schemas, tr):
        if schema is not None:
            answer = json.loads(tok.decode(result.ids, skip_special_tokens=True))
            assert _follows(answer, schema) and result.finish_reason == "grammar", answer
    anything = tr[len(schemas) - 3]  # json_object: an object once complete (this model may ramble to the length)
    assert anything.finish_reason == "length" or isinstance(json.loads(tok.decode(anything.ids)), dict)
    assert tok.decode(tr[len(schemas) - 2].ids) in ("yes", "no", "not sure")
    phone = tok.decode(tr[len(schemas) - 1].ids)
    assert len(phone) == 14 and phone[0] == "(" and phone[9] == "-", phone
    json_mat = [r.stats.mat for r in tr[: len(schemas) - 3]]
    plain_mat = [r.stats.mat for r in plain[: len(schemas) - 3]]
    assert sum(json_mat) > sum(plain_mat) and min(json_mat) > 1.3, (json_mat, plain_mat)


@pytest.mark.slow
def test_a_grammar_is_never_left_early_and_a_complete_one_ends_the_output(decoder):
    """EOS is forbidden until the grammar accepts, so a short max_new_tokens ends in "length"; once the
    grammar is complete the output ends there ("grammar"), even with ignore_eos."""
    msg = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    choice = StructuredOutput("choice", choices=("yes, it is in France", "no"))
    short = decoder.generate(GenerationRequest(messages=msg, max_new_tokens=2, structured=choice))
    assert short.finish_reason == "length" and len(short.ids) == 2
    done = decoder.generate(GenerationRequest(messages=msg, max_new_tokens=16, structured=choice, ignore_eos=True))
    assert done.finish_reason == "grammar" and decoder.tokenizer.decode(done.ids) in ("yes, it is in France", "no")
