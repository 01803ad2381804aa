"""Confidences beside the matrix ids over the matrix API: PushRows, DraftSession steps, Checkout,
the remote and replica clients, and refusal of malformed probs (INVALID_ARGUMENT, nothing stored)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from trserve.core.model_spec import ModelSpec
from trserve.engine.tr.recycle import RecycledRows
from trserve.engine.tr.tree import TreeTemplate, get_compiled
from trserve.services.common.matrix_convert import rows_from_pb, rows_to_pb
from trserve.services.worker.drafting.remote import RemoteDraftSource
from trserve.services.worker.drafting.replica import ReplicaDraftSource
from tests.helpers import wait_for
from tests.services.matrix_helpers import (  # noqa: F401 - fixtures
    FP,
    K,
    V,
    channel_to,
    checkout_probs,
    model,
    push,
    redis_prefix,
    start_server,
)
from trserve.v1 import matrix_pb2 as pb

pytestmark = pytest.mark.redis
SPEC = ModelSpec(FP, V, K)
TREE = TreeTemplate.from_paths("t", [[0], [1], [0, 0]])


def _batch(seed: int, m: int = 12) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """m distinct tokens, their ids [m, K] and confidences [m, K] uint8 (nonzero)."""
    rng = np.random.default_rng(seed)
    tokens = rng.choice(V, m, replace=False)
    return tokens, rng.integers(0, V, (m, K)), rng.integers(1, 256, (m, K), np.uint8)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_row_batch_conversion_round_trips_and_checks_the_probs_length() -> None:
    tokens, topk, probs = _batch(0, m=3)
    got = rows_from_pb(rows_to_pb(tokens, topk, probs), K)
    assert np.array_equal(got[0], tokens) and np.array_equal(got[1], topk) and np.array_equal(got[2], probs)
    assert got[2].dtype == np.uint8
    assert rows_from_pb(rows_to_pb(tokens, topk), K)[2] is None  # empty = unknown
    assert rows_from_pb(pb.RowBatch(), K)[2] is None
    for wrong in (1, 3 * K - 1, 3 * K + 1, 4 * K):
        bad = rows_to_pb(tokens, topk)
        bad.probs = b"\x01" * wrong
        with pytest.raises(ValueError, match=f"i.e. {3 * K} bytes"):
            rows_from_pb(bad, K)


def test_push_rows_and_checkout_carry_probs(start_server, channel_to) -> None:
    server = start_server()
    stub = channel_to(server)
    tokens, topk, probs = _batch(1)
    assert push(stub, "t", rows_to_pb(tokens, topk, probs)) == 1
    version, rows, got = checkout_probs(stub, "t")
    assert version == 1 and np.array_equal(rows[tokens], topk) and np.array_equal(got[tokens], probs)
    assert int(np.count_nonzero(got.any(axis=1))) == len(tokens)
    stored = server.store.checkout(SPEC, "t")
    assert np.array_equal(stored.probs, got) and np.array_equal(stored.rows, rows)
    # an ids-only batch (an older client): those rows' confidences become unknown, the others stay
    assert push(stub, "t", rows_to_pb(tokens[:2], topk[:2])) == 2
    after = checkout_probs(stub, "t")[2]
    assert not after[tokens[:2]].any() and np.array_equal(after[tokens[2:]], probs[2:])


def test_a_row_with_zero_ids_but_known_probs_is_checked_out(start_server, channel_to) -> None:
    stub = channel_to(start_server())
    push(stub, "t", rows_to_pb(np.array([7]), np.zeros((1, K), int), np.full((1, K), 3, np.uint8)))
    _, rows, probs = checkout_probs(stub, "t")
    assert not rows.any() and probs[7].tolist() == [3] * K


def test_bad_probs_length_is_invalid_argument_and_the_stored_matrix_unchanged(start_server, channel_to) -> None:
    server = start_server()
    stub = channel_to(server)
    tokens, topk, probs = _batch(2)
    push(stub, "t", rows_to_pb(tokens, topk, probs))
    before = server.store.checkout(SPEC, "t")
    new_tokens, new_topk, _ = _batch(3)
    good = rows_to_pb(new_tokens, new_topk)
    for n_bytes in (1, len(new_tokens) * K - 1, len(new_tokens) * K + 1):
        bad = pb.RowBatch(tokens=good.tokens, topk=good.topk, probs=b"\x07" * n_bytes)
        code, details = _code(lambda: push(stub, "t", bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "rows.probs" in details, details
        requests = [pb.DraftRequest(open=pb.DraftOpen(tenant="t", model=model(), tree="paper")),
                    pb.DraftRequest(step=pb.DraftStep(rows=bad, root=1))]
        code, details = _code(lambda: list(stub.DraftSession(iter(requests), timeout=10)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "rows.probs" in details, details
        final = requests[:1] + [pb.DraftRequest(step=pb.DraftStep(rows=bad, final=True))]
        assert _code(lambda: list(stub.DraftSession(iter(final), timeout=10)))[0] == grpc.StatusCode.INVALID_ARGUMENT
    after = server.store.checkout(SPEC, "t")
    assert after.version == before.version == 1
    assert np.array_equal(after.rows, before.rows) and np.array_equal(after.probs, before.probs)


def test_remote_session_steps_send_probs(start_server) -> None:
    server = start_server()
    source = RemoteDraftSource(server.addr, "t")
    session = source.open(get_compiled(TREE, "cpu", torch.float32), SPEC)
    tokens, topk, probs = _batch(4)
    session.step(RecycledRows(torch.tensor(tokens), torch.tensor(topk, dtype=torch.int32), torch.tensor(probs)), 1)
    last_tokens, last_topk, _ = _batch(5, m=3)
    last = RecycledRows(torch.tensor(last_tokens), torch.tensor(last_topk, dtype=torch.int32))  # probs unknown
    session.close(last)
    assert session.info().mode == "remote"
    source.close()
    stored = server.store.checkout(SPEC, "t")
    assert stored.version == 2 and not stored.probs[last_tokens].any()
    rest = ~np.isin(tokens, last_tokens)  # [m]: rows the final batch left alone
    assert rest.any() and np.array_equal(stored.probs[tokens[rest]], probs[rest])


def test_replica_checks_out_probs_and_pushes_them(start_server, channel_to) -> None:
    server = start_server()
    tokens, topk, probs = _batch(6)
    push(channel_to(server), "t", rows_to_pb(tokens, topk, probs))
    source = ReplicaDraftSource(server.addr, "t")
    session = source.open(get_compiled(TREE, "cpu", torch.float32), SPEC)
    assert session.info().mode == "replica" and session.version == 1
    stored = server.store.checkout(SPEC, "t")
    assert np.array_equal(session.matrix.probs.numpy(), stored.probs) and session.matrix.probs.dtype == torch.uint8
    assert np.array_equal(session.matrix.rows.numpy(), stored.rows)
    new_tokens, new_topk, new_probs = _batch(7, m=5)
    session.step(RecycledRows(torch.tensor(new_tokens), torch.tensor(new_topk, dtype=torch.int32),
                              torch.tensor(new_probs)), 1)
    plain = np.setdiff1d(np.arange(20), np.concatenate([tokens, new_tokens]))[:2]
    session.close(RecycledRows(torch.tensor(plain), torch.ones((2, K), dtype=torch.int32)))  # probs unknown
    wait_for(lambda: server.store.checkout(SPEC, "t").version >= 2)
    source.close()
    after = server.store.checkout(SPEC, "t")
    fresh = ~np.isin(new_tokens, tokens)  # rows the checkout had no confidences for: stored as recycled
    assert fresh.any() and np.array_equal(after.probs[new_tokens[fresh]], new_probs[fresh])
    assert after.probs[new_tokens].all() and not after.probs[plain].any()
    assert np.array_equal(after.probs, session.matrix.probs.numpy())  # the service holds what the copy holds
