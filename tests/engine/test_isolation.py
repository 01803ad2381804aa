"""One request's own failure ends that request alone (issue 56, defect 1): a victim decoding beside
requests whose grammar hits a limit of the grammar engine while decoding, or whose rules leave no
token allowed (greedy and sampled, `tr` and `ar`, at the first token and in a decoding step), commits
exactly its output alone; each attacker's caller gets OutputStuck; the engine goes on serving and its
prefix cache keeps what it held."""

from __future__ import annotations

import pytest

from trserve.core.errors import OutputStuck
from trserve.engine import GenerationRequest
from trserve.engine.engine import BatchEngine, EngineConfig
from trserve.engine.results import GenerationResult
from trserve.engine.tr.grammar import StructuredOutput
from trserve.engine.tr.sampling import SamplingParams

VICTIM = dict(messages=[{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}],
              max_new_tokens=40, ignore_eos=True)
ASK = [{"role": "user", "content": "Answer with one letter."}]
# "A" ends it; "Z" leads (after a second "Z" for the decoding-step case) to a row of 2001 alternatives,
# past the grammar engine's 2000 items a row: the validation walk takes the lowest id ("A") and passes
WIDE = " | ".join(f'"o{i}"' for i in range(2001))
AT_FIRST = StructuredOutput("grammar", f'start: "A" | "Z" x\nx: {WIDE}')
IN_A_STEP = StructuredOutput("grammar", f'start: "A" | "Z" y\ny: "A" | "Z" x\nx: {WIDE}')


def _attackers(z: int, q: int) -> list[dict]:
    limit = [dict(messages=ASK, max_new_tokens=8, structured=s, logit_bias=((z, 100.0),))
             for s in (AT_FIRST, IN_A_STEP)]
    # "Z" then only "Q", a stop id here, which min_tokens forbids: no token allowed at output token 1
    dead = dict(messages=ASK, max_new_tokens=8, min_tokens=5, stop_token_ids=(q,),
                structured=StructuredOutput("grammar", 'start: "Z" "Q"'))
    out = []
    for kwargs in limit + [dead]:
        out += [dict(kwargs, mode="tr"), dict(kwargs, mode="ar"),
                dict(kwargs, mode="tr", sampling=SamplingParams(temperature=0.7, seed=3))]
    return out


def _run(decoder, requests: list[dict], start_after: int = 0) -> tuple[list, BatchEngine]:
    """Each request's last item (result or exception); requests after the first join once the first
    has decoded `start_after` steps."""
    engine = BatchEngine(decoder, EngineConfig(max_batch=16, prefill_chunk=128))
    matrix, outs = decoder.new_matrix(), [[] for _ in requests]
    engine.submit(decoder.prepare(GenerationRequest(**requests[0])), outs[0].append, matrix=matrix)
    with engine.stepping():
        while len(outs[0]) < start_after:
            engine.step()
        for kwargs, out in zip(requests[1:], outs[1:]):
            engine.submit(decoder.prepare(GenerationRequest(**kwargs)), out.append, matrix=matrix)
        while engine.running or engine.waiting or engine.prefilling:
            engine.step()
    return [out[-1] for out in outs], engine


@pytest.mark.parametrize("arithmetic", ["exact", "int8"])
def test_a_request_that_cannot_go_on_ends_alone(decoder, decoder_int8, arithmetic) -> None:
    d = decoder if arithmetic == "exact" else decoder_int8
    z, q = d.tokenizer.convert_tokens_to_ids(["Z", "Q"])
    alone = d.generate(GenerationRequest(**VICTIM))
    attackers = _attackers(z, q)
    results, engine = _run(d, [VICTIM] + attackers, start_after=3)
    victim = results[0]
    assert isinstance(victim, GenerationResult) and victim.ids == alone.ids and victim.finish_reason == "length"
    for kwargs, got in zip(attackers, results[1:]):
        assert isinstance(got, OutputStuck), (kwargs.get("mode"), kwargs["structured"].kind, got)
    kinds = [str(r) for r in results[1:]]
    assert all("max is 2000" in k for k in kinds[:6]), kinds[:6]
    assert all("no token is allowed at output token 1" in k and "min_tokens=5" in k for k in kinds[6:]), kinds[6:]
    assert any("at output token 0" in k for k in kinds[:3]) and any("at output token 1" in k for k in kinds[3:6])
    assert engine.prefix is None or engine.prefix.bytes > 0  # nothing cleared: the victim's row was kept
    again = _run(d, [VICTIM])[0][0]  # and the engine serves on
    assert again.ids == alone.ids
