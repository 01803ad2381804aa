"""The batching engine: many requests in one forward per step, each output as if decoded alone.

Tiny-model tests (fast) check the scheduling: chunked prefill, retirement, cancel/deadline freeing
the KV row at the next step, budgets. The real-model tests check losslessness in a batch.
"""

from __future__ import annotations

import time

import pytest
import torch

from trserve.engine import Decoder, GenerationRequest, SamplingParams
from trserve.engine.engine import BatchEngine, EngineConfig
from trserve.engine.results import GenerationResult, StepChunk
from tests.conftest import load_prompts, tiny_decoder
from tests.engine.test_lossless import NEAR_TIE_EPS, _reference
from tests.serial_oracle import serial_generate

V = 64


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_decoder(V, seed=1, seed_from_prompt=4, tree="cpu-8")
    torch.set_num_threads(threads)


def _run(engine: BatchEngine, until=None, limit: int = 10_000) -> int:
    steps = 0
    with torch.inference_mode():
        while (engine.running or engine.waiting or engine.prefilling) and steps < limit:
            engine.step()
            steps += 1
            if until is not None and until():
                break
    return steps


def _submit(engine: BatchEngine, decoder: Decoder, request: GenerationRequest, **kw) -> list:
    out: list = []
    engine.submit(decoder.prepare(request), out.append, **kw)
    return out


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * j) % V for j in range(n)]


def test_batch_equals_alone_and_chunks_add_up(tiny):
    requests = [GenerationRequest(input_ids=_prompt(i, 5 + 9 * i), max_new_tokens=20 + 3 * i, ignore_eos=True,
                                  mode="ar" if i == 2 else "tr") for i in range(5)]
    alone = [serial_generate(tiny, r) for r in requests]
    engine = BatchEngine(tiny, EngineConfig(max_batch=4, prefill_chunk=8))
    outs = [_submit(engine, tiny, r, matrix=tiny.new_matrix()) for r in requests]
    _run(engine)
    for a, out in zip(alone, outs):
        result = out[-1]
        assert isinstance(result, GenerationResult) and result.ids == a.ids and result.finish_reason == "length"
        assert [t for c in out[:-1] if isinstance(c, StepChunk) for t in c.tokens] == result.ids
    assert engine.runner.kv.active == 0 and engine.reserved == 0  # every row and reservation freed


def test_chunks_without_text_for_a_caller_that_reads_only_the_result(decoder):
    """submit(text=False) (a unary call): no detokenization per step; the same tokens and result text."""
    from trserve.engine.engine import BatchEngine as Engine

    engine = Engine(decoder, EngineConfig(max_batch=2))
    request = GenerationRequest(messages=[{"role": "user", "content": "Say hello in French."}], max_new_tokens=12)
    outs = {flag: _submit(engine, decoder, request, text=flag) for flag in (True, False)}
    with engine.stepping():
        _run(engine)
    (*with_text, a), (*without, b) = outs[True], outs[False]
    assert a.ids == b.ids and a.text == b.text and "".join(c.text for c in with_text) == a.text != ""
    assert [t for c in without for t in c.tokens] == b.ids and all(c.text == "" for c in without)


def test_static_batch_steps_decode_as_the_eager_ones(tiny):
    """The GPU's batch step (fixed-shape buckets, a CUDA graph each there) through the engine, on the
    CPU: 3 rows run as 4 (a pad row) while a 4th request prefills, and each output is the eager one's."""
    static = tiny_decoder(V, seed=1, batch_step="static", seed_from_prompt=4, tree="cpu-8")  # tiny's weights
    requests = [GenerationRequest(input_ids=_prompt(i, 5 + 13 * i), max_new_tokens=18 + 3 * i, ignore_eos=True,
                                  mode="ar" if i == 1 else "tr") for i in range(5)]
    want = [serial_generate(tiny, r).ids for r in requests]
    assert [static.generate(r).ids for r in requests] == want  # the engine alone: one row, bucket 1
    engine = BatchEngine(static, EngineConfig(max_batch=3, prefill_chunk=8))
    assert engine.runner.static is not None
    outs = [_submit(engine, static, r, matrix=static.new_matrix()) for r in requests]
    _run(engine)
    assert [o[-1].ids for o in outs] == want
    assert engine.runner.kv.active == 0


def test_seeded_sampling_in_a_batch_gives_the_tokens_of_alone(tiny):
    requests = [GenerationRequest(input_ids=_prompt(i, 6), max_new_tokens=16, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i)) for i in range(4)]
    alone = [serial_generate(tiny, r).ids for r in requests]
    engine = BatchEngine(tiny, EngineConfig(max_batch=4))
    outs = [_submit(engine, tiny, r) for r in requests]
    _run(engine)
    assert [o[-1].ids for o in outs] == alone


def test_long_prompt_is_prefilled_in_chunks_while_the_others_decode(tiny):
    engine = BatchEngine(tiny, EngineConfig(max_batch=4, prefill_chunk=16))
    short = _submit(engine, tiny, GenerationRequest(input_ids=_prompt(1, 4), max_new_tokens=200, ignore_eos=True))
    _run(engine, until=lambda: bool(engine.running))
    long = _submit(engine, tiny, GenerationRequest(input_ids=_prompt(2, 100), max_new_tokens=4, ignore_eos=True))
    chunks_before = len(short)
    steps = _run(engine, until=lambda: len(engine.running) == 2)
    assert steps == 7  # ceil(100 / 16) prefill chunks, one per step
    assert len(short) - chunks_before == steps  # the running request got a step every time
    _run(engine)
    assert len(long[-1].ids) == 4 and len(short[-1].ids) == 200


def test_cancel_and_deadline_free_the_row_at_the_next_step(tiny):
    engine = BatchEngine(tiny, EngineConfig(max_batch=4))
    flags = {"cancel": False}
    keep = _submit(engine, tiny, GenerationRequest(input_ids=_prompt(1, 5), max_new_tokens=300, ignore_eos=True))
    gone = _submit(engine, tiny, GenerationRequest(input_ids=_prompt(2, 5), max_new_tokens=300, ignore_eos=True),
                   cancelled=lambda: flags["cancel"])
    late = _submit(engine, tiny, GenerationRequest(input_ids=_prompt(3, 5), max_new_tokens=300, ignore_eos=True),
                   deadline=time.monotonic() + 3600)
    _run(engine, until=lambda: len(engine.running) == 3)
    reserved = engine.reserved
    flags["cancel"] = True
    engine.running[2].caller.deadline = 0.0  # now past
    _run(engine, limit=1)
    assert engine.runner.kv.active == 1 and len(engine.running) == 1 and engine.reserved < reserved
    assert gone[-1].finish_reason == "cancelled" and late[-1].finish_reason == "time_limit"
    assert not isinstance(keep[-1], GenerationResult)
    _run(engine)
    assert len(keep[-1].ids) == 300


def test_a_failing_finish_reaches_its_caller_and_a_failing_session_close_loses_no_output(tiny, monkeypatch):
    """Whatever raises while a request finishes, its caller hears back (it once waited forever: the
    request had left every list the failed step's clean-up reads), and the engine serves on. A draft
    session whose close raises costs only its last rows: the result still comes, whole."""
    from trserve.engine import engine as engine_module
    from trserve.engine.tr.source import MatrixSession

    request = GenerationRequest(input_ids=_prompt(4, 6), max_new_tokens=12, ignore_eos=True)
    want = serial_generate(tiny, request).ids
    engine = BatchEngine(tiny, EngineConfig(max_batch=2))

    def refuse(*args, **kwargs):
        raise RuntimeError("stats exploded")

    with monkeypatch.context() as m:
        m.setattr(engine_module.GenerationStats, "build", refuse)
        broken = _submit(engine, tiny, request, matrix=tiny.new_matrix())
        _run(engine, limit=200)
    assert len(broken) >= 1 and isinstance(broken[-1], RuntimeError) and "stats exploded" in str(broken[-1])

    def close_fails(self, recycled):
        raise ConnectionError("matrix store gone")

    with monkeypatch.context() as m:
        m.setattr(MatrixSession, "close", close_fails)
        unclosed = _submit(engine, tiny, request, matrix=tiny.new_matrix())
        _run(engine, limit=200)
    assert isinstance(unclosed[-1], GenerationResult) and unclosed[-1].ids == want
    after = _submit(engine, tiny, request, matrix=tiny.new_matrix())
    _run(engine, limit=200)
    assert isinstance(after[-1], GenerationResult) and after[-1].ids == want and not engine.running


def test_a_prompt_whose_next_chunk_would_end_past_its_deadline_stops_before_the_deadline(tiny):
    engine = BatchEngine(tiny, EngineConfig(max_batch=2, prefill_chunk=8))
    out = _submit(engine, tiny, GenerationRequest(input_ids=_prompt(4, 40), max_new_tokens=4, ignore_eos=True),
                  deadline=time.monotonic() + 3600)
    with torch.inference_mode():
        engine.step()  # its first chunk: its per-token rate is measured
    live = engine.prefilling
    assert live.place.done == 8 and live.place.prefill_token_s > 0
    # the deadline falls inside the next chunk (as the rate measured): it stops now, before the deadline
    live.place.prefill_token_s = 1.0  # the next 8 tokens would take 8 s
    live.caller.deadline = time.monotonic() + 4.0
    _run(engine, limit=1)
    assert out[-1].finish_reason == "time_limit" and out[-1].ids == []
    assert time.monotonic() < live.caller.deadline and engine.prefilling is None and engine.runner.kv.active == 0
    # with room for the next chunk it goes on
    out = _submit(engine, tiny, GenerationRequest(input_ids=_prompt(4, 40), max_new_tokens=4, ignore_eos=True),
                  deadline=time.monotonic() + 3600)
    _run(engine)
    assert out[-1].finish_reason == "length" and len(out[-1].ids) == 4


def test_full_queue_and_oversized_requests_are_refused(tiny):
    from trserve.core.errors import ResourceExhausted

    engine = BatchEngine(tiny, EngineConfig(max_batch=1, max_waiting=1, max_batch_tokens=64))
    with pytest.raises(ResourceExhausted, match="KV tokens"):
        _submit(engine, tiny, GenerationRequest(input_ids=_prompt(1, 40), max_new_tokens=40))
    _submit(engine, tiny, GenerationRequest(input_ids=_prompt(1, 4), max_new_tokens=4))
    with pytest.raises(ResourceExhausted, match="max_waiting=1"):
        _submit(engine, tiny, GenerationRequest(input_ids=_prompt(2, 4), max_new_tokens=4))
    _run(engine)


def test_heavy_load_shrinks_trees_to_plain_steps(tiny):
    """Under a compute-bound cost (each token costs the same), plain decoding wins for every sequence."""
    engine = BatchEngine(tiny, EngineConfig(max_batch=8, explore_every=10**6), cost=lambda w, kv: float(w))
    outs = [_submit(engine, tiny, GenerationRequest(input_ids=_prompt(i, 6), max_new_tokens=12, ignore_eos=True))
            for i in range(6)]
    _run(engine)
    assert all(o[-1].stats.mat == 1.0 for o in outs)  # widths never grew
    # no tree paid, so a request admitted now seeds (almost) nothing from its prompt: its LM-head rows
    # over the prompt would buy drafts nobody verifies
    assert engine.budget.tree_share < 0.5
    late = _submit(engine, tiny, GenerationRequest(input_ids=_prompt(9, 6), max_new_tokens=4, ignore_eos=True))
    with torch.inference_mode():
        engine.step()
    assert engine.running[-1].drafting.seeding.n < tiny.config.seed_from_prompt
    _run(engine)
    assert late[-1].stats.mat == 1.0
    flat = BatchEngine(tiny, EngineConfig(max_batch=8), cost=lambda w, kv: 1.0)  # free width: whole trees
    outs = [_submit(flat, tiny, GenerationRequest(input_ids=_prompt(i, 6), max_new_tokens=12, ignore_eos=True),
                    matrix=tiny.new_matrix()) for i in range(6)]
    _run(flat)
    assert sum(o[-1].stats.mat for o in outs) / 6 > 1.0


def test_prompt_seeding_skips_rows_the_tenant_already_knows(tiny):
    """Prompt seeding costs an LM-head row per position: only rows the tenant's matrix lacks are seeded."""
    engine = BatchEngine(tiny, EngineConfig(max_batch=2), cost=lambda w, kv: 1.0)
    matrix = tiny.new_matrix()

    def seeded(prompt: list[int]) -> list[int]:
        out = _submit(engine, tiny, GenerationRequest(input_ids=prompt, max_new_tokens=3, ignore_eos=True),
                      matrix=matrix)
        with torch.inference_mode():
            engine.step()  # the whole prompt in one chunk: it joins the batch
        at = engine.running[-1].drafting.seeding.at
        _run(engine)
        assert out[-1].stats.generated_tokens == 3
        return [prompt[q] for q in at]

    first = [11, 12, 13, 14, 15, 16]
    assert seeded(first) == first[-4:]  # a cold matrix: the last seed_from_prompt positions
    assert seeded([40, 41] + first[-4:]) == []  # the same last tokens: their rows are known now
    assert seeded([40, 41, 14, 30, 31, 30]) == [31, 30]  # 14 is known since the first; 30 once, at its last


# ---- the real model -------------------------------------------------------------------------------
def _mixed_prompts(n: int) -> list[str]:
    spec = load_prompts("spec_bench")
    by_cat: dict[str, list[str]] = {}
    for q in spec:
        by_cat.setdefault(q["category"], []).append(q["turns"][0])
    picked = [qs[2] for qs in by_cat.values()]  # one per category: short chats to long rag/summarization prompts
    return picked[-n:]


@pytest.mark.slow
def test_real_prompts_from_several_tenants_decode_in_a_batch_as_alone(decoder, hf_reference):
    prompts = _mixed_prompts(12)
    assert len(prompts) == 12
    ids = [decoder.prompts.chat_ids([{"role": "user", "content": p}]) for p in prompts]
    assert max(map(len, ids)) > 4 * min(map(len, ids))  # mixed lengths
    requests = [GenerationRequest(input_ids=x, max_new_tokens=64, ignore_eos=True) for x in ids]
    tenants = [decoder.new_matrix() for _ in range(3)]  # each tenant's matrix shared by its concurrent requests
    # every sequence verifies its whole tree each step (batch-aware budgets would turn 12 rows' trees
    # down on this CPU): tree verification inside a batch is what is tested here
    engine = BatchEngine(decoder, EngineConfig(max_batch=16, prefill_chunk=128, batch_aware=False))
    outs = [_submit(engine, decoder, r, matrix=tenants[i % 3], tenant=f"t{i % 3}") for i, r in enumerate(requests)]
    _run(engine)
    near_ties = []
    for x, request, out in zip(ids, requests, outs):
        batched = out[-1].ids
        alone = serial_generate(decoder, request).ids
        if batched == alone:
            continue
        ref, logits = _reference(hf_reference, x, 64)  # where they differ, the reference decides: a near-tie only
        for name, got in (("batched", batched), ("alone", alone)):
            if got == ref:
                continue
            p = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
            top2 = torch.topk(logits[p].float(), 2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE_EPS, f"{name} output diverges at {p} without a near-tie"
        near_ties.append(p)
    assert len(near_ties) <= 2, near_ties
    assert sum(o[-1].stats.mat for o in outs) / len(outs) > 1.2  # drafts accepted inside the batch


@pytest.mark.slow
def test_real_prompts_on_the_gpu_code_path_decode_as_greedy(hf_reference):
    """The real model through the GPU's batch step (transformers' modules, fixed-shape buckets; on
    CUDA each is a CUDA graph) on the CPU: 3 requests of mixed lengths (3 rows run as 4) with whole
    trees, each output equal to plain greedy `generate` (near-tie rule as in the lossless test)."""
    from dataclasses import replace

    from trserve.engine import DecoderConfig

    decoder = Decoder(DecoderConfig(), loaded=replace(hf_reference, batch_step="static"))
    ids = [decoder.prompts.chat_ids([{"role": "user", "content": p}]) for p in _mixed_prompts(12)[::4]]
    engine = BatchEngine(decoder, EngineConfig(max_batch=3, prefill_chunk=128, batch_aware=False))
    assert engine.runner.static is not None and engine.runner.forward_kind == "transformers"
    requests = [GenerationRequest(input_ids=x, max_new_tokens=64, ignore_eos=True) for x in ids]
    outs = [_submit(engine, decoder, r, matrix=decoder.new_matrix()) for r in requests]
    _run(engine)
    for x, out in zip(ids, outs):
        got = out[-1].ids
        assert out[-1].finish_reason == "length" and len(got) == 64, (out[-1].finish_reason, len(got))
        ref, logits = _reference(hf_reference, x, 64)
        if got != ref:
            p = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
            top2 = torch.topk(logits[p].float(), 2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE_EPS, f"diverges at {p} without a near-tie"
    assert sum(o[-1].stats.mat for o in outs) / len(outs) > 1.2  # drafts accepted inside the batch


def test_a_width_never_measured_is_priced_at_the_host_speed(tiny):
    """Forwards measured 1.5x the calibration at width 4: width 4 costs what it measured, and width 5,
    never measured, the calibration x 1.5 (at the calibration's own speed it would look cheap next to
    width 4 and win steps it then loses)."""
    engine = BatchEngine(tiny, EngineConfig(max_batch=2), cost=lambda w, kv: 0.01 * w)
    for _ in range(200):
        engine.budget.costs.measured(4, 64, 0.06)
    assert engine.cost(4, 64) == pytest.approx(0.06, rel=1e-3)
    assert engine.cost(5, 64) == pytest.approx(0.075, rel=1e-3)
    for _ in range(200):  # width 1 measured at 2x the calibration: its own ratio on top of the host's speed
        engine.budget.costs.measured(1, 64, 0.02)
    assert engine.cost(1, 64) == pytest.approx(0.02, rel=1e-2)


def test_stepping_holds_what_the_engine_loop_holds(decoder):
    """A caller driving `step` itself (the concurrency bench) gets what `run` holds: inference mode,
    and torch's intra-op threads at 1 while the compressed kernels' pool runs (the bench once ran
    batched steps without it, ~2x slow); the caller's setting comes back after."""
    from trserve.engine.model.runner import uses_kernel_pool

    engine = BatchEngine(decoder, EngineConfig(max_batch=2))
    pool = uses_kernel_pool(decoder.model)
    assert pool == decoder.loaded.kernels.startswith("compressed")
    before = torch.get_num_threads()
    with engine.stepping():
        assert torch.is_inference_mode_enabled()
        assert torch.get_num_threads() == (1 if pool else before)
    assert torch.get_num_threads() == before and not torch.is_inference_mode_enabled()
