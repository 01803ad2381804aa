"""llama.cpp's own server as a bench peer (bench/llama_server.py): a real llama-server on a
loopback port, where `make llama-server` has built it (it takes minutes; without it these skip)."""

import pytest

from trserve.bench.llama_server import MODES, find_server, start_mode, tokens_per_forward


@pytest.fixture(scope="module")
def gguf():
    if find_server() is None:
        pytest.skip("llama-server is not built here (make llama-server)")
    from trserve.bench.runner import _bundled_gguf

    return _bundled_gguf()


@pytest.fixture(scope="module")
def prompt_ids(loaded_smollm2):
    messages = [{"role": "user", "content": "List the fruits again, numbered: apples, pears, plums, apples, pears."}]
    return list(loaded_smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_mode_decodes_greedily_on_its_own_server(gguf, prompt_ids, mode):
    server = start_mode(mode, gguf, threads=2)
    try:
        ids, timings = server.complete(prompt_ids, 24)
        streamed, ttft, stream_timings = server.stream(prompt_ids, 24)
    finally:
        server.close()
    assert 0 < len(ids) <= 24 and all(isinstance(t, int) for t in ids)
    assert streamed == ids  # greedy: the same ids streamed or not
    assert 0 < ttft and stream_timings.get("predicted_n") == len(ids)
    assert ("--spec-type" in server.cmd) == (mode == "llama-server-ngram")
    assert server.proc.poll() is not None  # closed: no server outlives its bench


def test_modes_run_in_separate_processes(gguf):
    """No peer mode may reuse another's prompt cache: each is its own server."""
    servers = [start_mode(mode, gguf, threads=1) for mode in sorted(MODES)]
    try:
        assert len({s.port for s in servers}) == len({s.proc.pid for s in servers}) == len(MODES)
    finally:
        for s in servers:
            s.close()


def test_tokens_per_forward_counts_accepted_drafts():
    assert tokens_per_forward({}, 10) == 1.0
    assert tokens_per_forward({"draft_n": 8, "draft_n_accepted": 5}, 10) == 2.0
    assert tokens_per_forward({"draft_n_accepted": None}, 0) == 1.0
