"""Fixed-shape batch steps (the CUDA graphs' code path, run eagerly here) equal the padded eager step."""

import pytest
import torch

from trserve.core.errors import InvalidArgument
from trserve.engine.model.runner import ModelRunner, RowInput
from trserve.engine.model.static_step import StaticStep, bucket, spare_rows
from trserve.engine.tr.tree import compile_tree, load_template
from tests.conftest import tiny_llama

TREES = [compile_tree(load_template(name)) for name in ("cpu-4", "cpu-8", "cpu-12")]


def _row(tokens: torch.Tensor, tree=None) -> RowInput:
    if tree is None:  # plain decoding: one token
        return RowInput(tokens[:1], torch.zeros(1, dtype=torch.long), torch.zeros(1, 1))
    return RowInput(tokens[: tree.n], tree.depth, tree.mask)


def _runners(model, max_rows: int, lens: list[int], g):
    """An eager and a static runner holding the same prefilled rows (all active)."""
    runners = [ModelRunner(model, max_rows, torch.float32, batch_step=s) for s in ("eager", "static")]
    prompts = [torch.randint(0, 128, (n,), generator=g) for n in lens]
    for runner in runners:
        for p in prompts:
            row = runner.kv.open_row()
            runner.prefill(row, p, torch.tensor([p.shape[0] - 1]))
            runner.kv.activate(row)
    return runners


def test_buckets_and_spare_rows():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 17)] == [1, 2, 4, 8, 8, 16, 32]
    assert spare_rows(17) == 32 - 17 + 1 and spare_rows(16) == 1


@torch.inference_mode()
def test_static_steps_equal_eager_steps_and_spare_the_prefilling_row():
    """Three rows of different lengths and widths (4 rows bucketed: one pad row) over several steps with
    compaction; a fourth row is mid-prefill the whole time and must keep its entries."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(3)
    eager, static = _runners(model, 5, [3, 9, 20], g)
    assert static.static is not None and eager.static is None
    prompt = torch.randint(0, 128, (40,), generator=g)  # longer than the active rows: the steps' columns
    for runner in (eager, static):  # row 3 prefilled but not active: the first inactive row
        runner.prefill(runner.kv.open_row(), prompt, torch.tensor([39]))
    held = static.kv.rows.k[0][3, :, :40].clone()
    for step in range(6):
        trees = [TREES[(step + i) % 3] if (step + i) % 4 else None for i in range(3)]
        tokens = [torch.randint(0, 128, (16,), generator=g) for _ in trees]
        rows = [_row(t, tree) for t, tree in zip(tokens, trees)]
        want, got = eager.step(rows), static.step(rows)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
        keep = []  # root + a random ancestor path of each tree
        for tree in trees:
            if tree is None:
                keep.append([0])
            else:
                keep.append(tree.path_to(int(torch.randint(0, tree.n, (1,), generator=g))))
        for runner in (eager, static):
            runner.keep(keep)
        assert eager.kv.rows.lens == static.kv.rows.lens
    assert torch.equal(static.kv.rows.k[0][3, :, :40], held)
    # the prefilled row joins and decodes like the others
    for runner in (eager, static):
        runner.kv.activate(3)
    rows = [_row(torch.randint(0, 128, (16,), generator=g), TREES[i % 3]) for i in range(4)]
    for a, b in zip(eager.step(rows), static.step(rows)):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)


@torch.inference_mode()
def test_static_step_survives_the_kv_growing():
    """Buffers reallocated (a row past the capacity): the shapes made for the old ones are dropped."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(4)
    eager, static = _runners(model, 2, [240, 5], g)  # 240 + a width of 16 fills the 256 columns
    rows = [_row(torch.randint(0, 128, (16,), generator=g), TREES[1]) for _ in range(2)]
    for a, b in zip(eager.step(rows), static.step(rows)):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
    gen = static.kv.rows.generation
    for runner in (eager, static):
        runner.keep([list(range(9)), [0]])
    rows = [_row(torch.randint(0, 128, (16,), generator=g), TREES[2]) for _ in range(2)]
    for a, b in zip(eager.step(rows), static.step(rows)):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
    assert static.kv.rows.generation > gen and static.kv.rows.capacity > 256


@torch.inference_mode()
def test_graphs_beyond_the_cap_replace_the_least_recently_used(monkeypatch):
    """The graph bookkeeping without a GPU: a stand-in capture whose replay runs the same buffers."""

    class Replay:
        def __init__(self, step, shape):
            self.step, self.shape = step, shape

        def replay(self):
            self.shape.out = self.step._run(self.shape)

    def capture(self, shape):
        shape.graph = Replay(self, shape)
        self.captured += 1

    monkeypatch.setattr(StaticStep, "_capture", capture)
    model = tiny_llama()
    g = torch.Generator().manual_seed(6)
    eager, static = _runners(model, 2, [4, 6], g)
    static.static.graphs, static.static.max_graphs = True, 2
    for tree in (None, TREES[0], TREES[1], None, TREES[2]):  # widths 1, 5, 9, 1, 13 -> buckets 1, 8, 16, 1, 16
        rows = [_row(torch.randint(0, 128, (16,), generator=g), tree) for _ in range(2)]
        for a, b in zip(eager.step(rows), static.step(rows)):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
        assert static.static.captured <= 2
    # 16 took the place of 1 (the least recently used), 1 again that of 8; 16 was then replayed
    assert [key[1] for key in static.static._shapes] == [1, 16]


@torch.inference_mode()
def test_logits_are_float32_on_a_bfloat16_model():
    """bfloat16 logits tie too often for exact greedy: the runner's LM head runs in float32."""
    model = tiny_llama().to(torch.bfloat16)
    runner = ModelRunner(model, 2, torch.bfloat16, batch_step="static")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 128, (6,), generator=g)
    row = runner.kv.open_row()
    first = runner.prefill(row, prompt, torch.tensor([5]))
    runner.kv.activate(row)
    tree = TREES[1]
    tokens = torch.randint(0, 128, (tree.n,), generator=g)
    (logits,) = runner.step([_row(tokens, tree)])
    assert first.dtype == logits.dtype == torch.float32 and logits.shape == (tree.n, 128)
    # the float32 product of the model's own (bfloat16) hidden state and head weight
    h = model.model(input_ids=torch.cat([prompt, tokens[:1]])[None]).last_hidden_state[0, -1]
    want = h.float() @ model.lm_head.weight.float().T
    torch.testing.assert_close(logits[0], want, atol=0.1, rtol=0.02)
    assert runner._head32[0].data_ptr() == ModelRunner(model, 1, torch.bfloat16)._head32[0].data_ptr()  # shared


def test_graphs_need_cuda():
    model = tiny_llama()
    with pytest.raises(ValueError, match="batch_step"):
        ModelRunner(model, 2, torch.float32, batch_step="warp")
    runner = ModelRunner(model, 2, torch.float32, batch_step="static")
    with pytest.raises(ValueError, match="CUDA"):
        StaticStep(runner._body, runner.kv, torch.float32, torch.device("cpu"), graphs=True)
    from trserve.engine.model.loader import ModelConfig, load_model

    with pytest.raises(ValueError, match="batch_step"):
        ModelConfig(batch_step="warp")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="CUDA"):
            load_model(ModelConfig(batch_step="graphs", device="cpu", kernels="stock"))
