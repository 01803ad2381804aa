"""The drafting boundary on tiny tensors: a session applies rows to its copy before drafting, and
subclasses only add where the rows go next."""

import numpy as np
import pytest
import torch

from trserve.core.errors import FingerprintMismatch
from trserve.core.model_spec import ModelSpec
from trserve.engine.tr.draft import draft_tokens, fill_levels
from trserve.engine.tr.matrix import AdjacencyMatrix
from trserve.engine.tr.recycle import RecycledRows
from trserve.engine.tr.source import LocalDraftSource, MatrixSession
from trserve.engine.tr.tree import TreeTemplate, compile_tree

SPEC = ModelSpec("fp", 10, 2)
TREE = compile_tree(TreeTemplate.from_paths("ex", [[0], [1], [0, 0]]))
ROWS = RecycledRows(torch.tensor([5, 7]), torch.tensor([[7, 9], [3, 4]], dtype=torch.int32))


def test_local_session_drafts_from_the_rows_it_was_just_given():
    matrix = AdjacencyMatrix(SPEC)
    session = LocalDraftSource(matrix).open(TREE, SPEC)
    assert session.step(None, 5).tolist() == [5, 0, 0, 0]  # cold
    assert session.step(ROWS, 5).tolist() == [5, 7, 9, 3]  # rows first, then the draft
    session.close(RecycledRows(torch.tensor([3]), torch.tensor([[1, 1]], dtype=torch.int32)))
    assert matrix.version == 2 and session.info().matrix_version == 2 and session.info().mode == "local"
    with pytest.raises(FingerprintMismatch):
        LocalDraftSource(matrix).open(TREE, ModelSpec("other", 10, 2))


def test_subclass_hooks_see_each_batch_once_and_fall_back_once():
    class Forwarding(MatrixSession):
        mode = "embedded"

        def __init__(self, *args):
            super().__init__(*args)
            self.sent = []

        def _step(self, recycled, root):
            self.sent.append(recycled)
            return super()._step(recycled, root)

        def _close(self, recycled):
            self.sent.append(recycled)

    session = Forwarding(AdjacencyMatrix(SPEC), TREE)
    assert session.step(ROWS, 5).tolist() == [5, 7, 9, 3]
    session.close(None)
    assert session.sent == [ROWS, None]
    assert session.fall_back() and not session.fall_back() and session.info().mode == "local-fallback"


def test_numpy_and_torch_drafting_share_one_gather():
    matrix = torch.zeros(10, 2, dtype=torch.int32)
    matrix[5], matrix[7] = torch.tensor([7, 9]), torch.tensor([3, 4])
    levels = [(s, e, p.numpy(), r.numpy()) for s, e, p, r in TREE.level_index]
    tokens = np.empty(TREE.n, np.int64)
    tokens[0] = 5
    fill_levels(tokens, matrix.numpy(), levels)
    assert tokens.tolist() == draft_tokens(matrix, 5, TREE).tolist() == [5, 7, 9, 3]


class _Garbage(MatrixSession):
    """A draft source gone wrong (a buggy or hostile matrix service): each step something else."""

    mode = "remote"

    def __init__(self, matrix, tree) -> None:
        super().__init__(matrix, tree)
        self.calls = 0

    def _step(self, recycled, root):
        self.calls += 1
        n, v = self.tree.n, self.matrix.vocab_size
        return [torch.full((n,), -3), torch.full((n,), v + 11), torch.zeros(n + 2, dtype=torch.long),
                torch.rand(n), torch.randint(0, v, (n,))][self.calls % 5]


class _GarbageSource:
    def __init__(self, spec) -> None:
        self.spec = spec

    def open(self, tree, spec):
        return _Garbage(AdjacencyMatrix(spec), tree)


def test_drafts_entering_the_engine_are_made_safe():
    session = _Garbage(AdjacencyMatrix(SPEC), TREE)
    for _ in range(5):
        drafted = session.step(None, 5)
        assert drafted.shape == (TREE.n,) and drafted.dtype == torch.long and drafted[0] == 5
        assert bool(((drafted >= 0) & (drafted < SPEC.vocab_size)).all())


def test_matrix_rows_from_elsewhere_are_checked():
    rows = torch.tensor([[1, 2]] * 10, dtype=torch.int32)
    rows[3] = torch.tensor([-1, 10])
    m = AdjacencyMatrix(SPEC, rows=rows)
    assert m.rows[3].tolist() == [0, 0] and m.rows[2].tolist() == [1, 2]
    with pytest.raises(ValueError, match="integer token ids"):
        AdjacencyMatrix(SPEC, rows=torch.zeros(10, 2))


def test_garbage_drafts_still_give_the_models_own_output(decoder):
    """Out-of-range, negative, wrong-shape and float drafts reach neither the embedding nor the output."""
    chat = [{"role": "user", "content": "Name three colors."}]
    plain = decoder.generate(messages=chat, max_new_tokens=12, mode="ar")
    tr = decoder.generate(messages=chat, max_new_tokens=12, matrix=_GarbageSource(decoder.spec))
    assert tr.ids == plain.ids


def test_every_session_has_every_member_of_the_contract_and_the_engine_probes_none():
    """Issue 43, item 6: the DraftSession Protocol names every member the engine and drafter use; each
    source's session class has them all, and engine code calls them without getattr/hasattr/isinstance."""
    import inspect
    import re
    from pathlib import Path

    from trserve.engine.tr.source import DraftSession
    from trserve.services.worker.drafting.embedded import StoreDraftSession
    from trserve.services.worker.drafting.remote import RemoteDraftSession
    from trserve.services.worker.drafting.replica import ReplicaDraftSession

    members = {name for name in vars(DraftSession) if not name.startswith("_")} | set(DraftSession.__annotations__)
    assert {"step", "update", "close", "info", "known_rows", "remember", "matrix", "history", "local_drafts"} <= members
    session = LocalDraftSource(AdjacencyMatrix(SPEC)).open(TREE, SPEC)
    assert all(hasattr(session, m) for m in members)
    for cls in (StoreDraftSession, RemoteDraftSession, ReplicaDraftSession):
        assert issubclass(cls, MatrixSession), cls  # so they carry the instance members MatrixSession sets
        assert all(hasattr(cls, m) for m in members - set(DraftSession.__annotations__) | {"local_drafts"}), cls
    engine = Path(inspect.getfile(DraftSession)).parents[1]
    for path in (engine / "engine.py", engine / "drafting" / "drafter.py", engine / "drafting" / "step.py",
                 engine / "drafting" / "budget" / "tree.py"):
        text = path.read_text()
        assert not re.search(r"(getattr|hasattr)\([^)]*session|isinstance\([^)]*session", text), path
