"""The batch KV layout on tiny tensors: per-row compaction, row retirement and prefill rows."""

import torch

from trserve.engine.model.batch_kv import BatchKV
from tests.conftest import tiny_llama


def _kv(rows: int = 3) -> BatchKV:
    kv = BatchKV(tiny_llama().config, rows, torch.float32, torch.device("cpu"))
    kv.reserve(16)
    for i, k in enumerate(kv.rows.k):  # every entry says where it is: row * 100 + column
        cols = torch.arange(k.shape[2]).float()
        k[:] = (torch.arange(rows).float()[:, None] * 100 + cols)[:, None, :, None]
        kv.rows.v[i][:] = k
    return kv


def _col(kv: BatchKV, row: int, n: int) -> list[int]:
    return kv.rows.k[0][row, 0, :n, 0].int().tolist()


def test_keep_moves_each_rows_accepted_entries_down():
    kv = _kv()
    kv.rows.lens[:2], kv.rows.active = [3, 5], 2
    kv.for_batch(2)  # the step writes columns 5, 6 of both rows
    assert kv.rows.offset == 5
    kv.keep([[0, 1], [0]])
    assert kv.rows.lens[:2] == [5, 6]
    assert _col(kv, 0, 5) == [0, 1, 2, 5, 6] and _col(kv, 1, 6) == [100, 101, 102, 103, 104, 105]


def test_close_row_moves_the_last_row_into_the_hole():
    kv = _kv()
    kv.rows.lens[:3], kv.rows.active = [2, 3, 4], 3
    assert kv.close_row(0) == 2
    assert kv.rows.active == 2 and kv.rows.lens[:2] == [4, 3] and _col(kv, 0, 4) == [200, 201, 202, 203]
    assert kv.close_row(1) is None and kv.rows.active == 1


def test_prefill_row_is_single_and_joins_in_order():
    kv = _kv()
    row = kv.open_row()
    assert row == 0 and kv.rows.lens[0] == 0
    kv.for_row(row, 4)
    assert kv.cache.get_seq_length() == 0 and kv.rows.single == 0
    kv.grow(row, 4)
    kv.activate(row)
    assert kv.active == 1 and kv.length(0) == 4


def test_new_capacity_is_zeros_not_stale_memory():
    """Masked holes are still multiplied by the queries: stale inf/NaN there would poison a row."""
    kv = BatchKV(tiny_llama().config, 2, torch.float32, torch.device("cpu"))
    kv.reserve(8)
    kv.rows.k[0][:, :, :8] = float("nan")  # as if a previous tenant of this memory left NaNs
    kv.rows.lens[0] = 8
    kv.reserve(1000)  # grows: the valid 8 columns are copied, the rest is new
    assert torch.isnan(kv.rows.k[0][0, :, :8]).all() and kv.rows.k[0][:, :, 8:].eq(0).all()
