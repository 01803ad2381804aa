"""Decoding SmolLM2 through the matrix service (remote and replica) gives the in-process tokens,
the tenant's matrix ends up with the rows an in-process matrix would hold, and a service that is
down or dies mid-request leaves the request complete and identical ("local-fallback")."""

from __future__ import annotations

import numpy as np
import pytest

from trserve.core.model_spec import ModelSpec
from trserve.services.worker.drafting.link import DraftClientConfig, fallback_count
from trserve.services.worker.drafting.remote import RemoteDraftSource
from trserve.services.worker.drafting.replica import ReplicaDraftSource
from tests.services.matrix_helpers import redis_prefix, start_server  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow, pytest.mark.redis]

PROMPTS = [
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "List three uses of a paperclip."}],
]
N = 32
# a static tree: the same nodes verified on every run (a grown tree also depends on the engine's
# calibration so far), so the service's rows can be compared with an in-process run's
TREE = "cpu-hybrid"
SOURCES = {"remote": RemoteDraftSource, "replica": ReplicaDraftSource}


def _no_cached_prefix(decoder) -> None:
    """Runs compared row for row must prefill the same prompt positions: a prompt whose KV comes from
    the prefix cache seeds its matrix only from the positions it prefills (engine/prefix_cache.py)."""
    if decoder.engine.prefix is not None:
        decoder.engine.prefix.clear()


@pytest.fixture(scope="module")
def reference(decoder):
    """In-process TR from a cold matrix, per prompt: (ids, final matrix rows, final matrix probs)."""
    out = []
    for messages in PROMPTS:
        _no_cached_prefix(decoder)
        matrix = decoder.new_matrix()
        result = decoder.generate(messages=messages, max_new_tokens=N, matrix=matrix, tree=TREE)
        out.append((result.ids, matrix.rows.numpy().copy(), matrix.probs.numpy().copy()))
    return out


@pytest.mark.parametrize("mode", SOURCES)
def test_decoding_through_the_service_equals_in_process(decoder, reference, start_server, mode) -> None:
    server = start_server()
    spec = ModelSpec(decoder.fingerprint, decoder.vocab_size, decoder.config.k)
    for i, (messages, (ids, rows, probs)) in enumerate(zip(PROMPTS, reference)):
        source = SOURCES[mode](server.addr, f"{mode}-{i}")
        _no_cached_prefix(decoder)
        result = decoder.generate(messages=messages, max_new_tokens=N, matrix=source, tree=TREE)
        source.close()
        assert result.ids == ids
        assert result.stats.draft_mode == mode and source.fallbacks == 0
        served = server.store.checkout(spec, f"{mode}-{i}")
        assert np.array_equal(served.rows, rows)  # every recycled row reached the service
        assert probs.any() and np.array_equal(served.probs, probs)  # with its confidences
        assert result.stats.matrix_version == served.version > 0


@pytest.mark.parametrize("mode", SOURCES)
def test_service_killed_mid_request_completes_identically(decoder, reference, start_server, mode) -> None:
    server = start_server()
    source = SOURCES[mode](server.addr, f"kill-{mode}")
    steps = []

    def kill_on_fifth_step() -> bool:  # the decoder polls this once per step
        steps.append(1)
        if len(steps) == 5:
            server.stop(0, final_snapshot=False)
        return False

    before = fallback_count()
    result = decoder.generate(messages=PROMPTS[0], max_new_tokens=N, matrix=source, cancelled=kill_on_fifth_step)
    source.close()
    assert result.ids == reference[0][0]
    assert result.stats.draft_mode == "local-fallback"
    assert source.fallbacks == 1 and fallback_count() == before + 1


def test_service_unreachable_at_open_drafts_locally(decoder, reference) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    config = DraftClientConfig(open_timeout_s=0.5)
    for cls in SOURCES.values():
        source = cls(f"127.0.0.1:{port}", "t", config=config)
        result = decoder.generate(messages=PROMPTS[1], max_new_tokens=N // 2, matrix=source)
        source.close()
        assert result.ids == reference[1][0][: N // 2] and result.stats.draft_mode == "local-fallback"
