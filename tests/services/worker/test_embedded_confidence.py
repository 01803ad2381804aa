"""The embedded draft source carries the matrix's confidences: a session's copy starts from the
store's probs, and every step's recycled probs reach the store (zeros where the engine had none)."""

from __future__ import annotations

import numpy as np
import torch

from trserve.core.model_spec import ModelSpec
from trserve.engine.tr.recycle import RecycledRows
from trserve.engine.tr.tree import TreeTemplate, get_compiled
from trserve.matrix_store import MatrixStore, StoreConfig
from trserve.services.worker.drafting.embedded import StoreDraftSource

SPEC = ModelSpec("fp", 1000, 8)
TREE = get_compiled(TreeTemplate.from_paths("t", [[0], [1], [0, 0]]), "cpu", torch.float32)


def test_embedded_sessions_check_out_and_apply_probs() -> None:
    store = MatrixStore(StoreConfig())
    store.apply(SPEC, "t", np.array([3, 4]), np.full((2, 8), 5), probs=np.full((2, 8), 60, np.uint8))
    session = StoreDraftSource(store, SPEC, "t", None).open(TREE, SPEC)
    assert session.info().mode == "embedded"
    assert session.matrix.probs.dtype == torch.uint8 and session.matrix.probs[3].tolist() == [60] * 8
    with_probs = RecycledRows(torch.tensor([7, 3]), torch.full((2, 8), 9, dtype=torch.int32),
                              torch.tensor([[200] * 8, [100] * 8], dtype=torch.uint8))
    session.step(with_probs, 7)
    session.close(RecycledRows(torch.tensor([4]), torch.full((1, 8), 2, dtype=torch.int32)))  # probs unknown
    out = store.checkout(SPEC, "t")
    assert out.version == 3 and session.info().mode == "embedded"
    # row 7 was unknown: its new confidences as they came; row 3 had some, which the session may
    # blend in (engine/tr/source.py); either way the store holds what the session's copy holds
    assert out.probs[7].tolist() == [200] * 8 and out.probs[3].any() and not out.probs[4].any()
    assert np.array_equal(out.probs, session.matrix.probs.numpy()) and np.array_equal(out.rows, session.matrix.rows)
    store.close()


def test_a_store_refusing_bad_probs_leaves_the_stored_matrix_unchanged() -> None:
    """Probs of the wrong shape handed to the store (here straight to the session's store write,
    past the engine) are refused: the session drafts locally and the stored matrix stays as it was."""
    store = MatrixStore(StoreConfig())
    store.apply(SPEC, "t", np.array([3]), np.full((1, 8), 5), probs=np.full((1, 8), 60, np.uint8))
    before = store.checkout(SPEC, "t")
    session = StoreDraftSource(store, SPEC, "t", None).open(TREE, SPEC)
    session._close(RecycledRows(torch.tensor([3]), torch.full((1, 8), 9, dtype=torch.int32),
                                torch.zeros((1, 7), dtype=torch.uint8)))
    assert session.info().mode == "local-fallback"
    after = store.checkout(SPEC, "t")
    assert after.version == before.version
    assert np.array_equal(after.rows, before.rows) and np.array_equal(after.probs, before.probs)
    store.close()
