"""The concurrency bench's summary: the prefill share and decode-only tokens/s of a level."""

import pytest

from trserve.bench.concurrency import _summary, format_sources, format_table


def test_summary_splits_prefill_from_decode():
    done = [{"tokens": 64, "latency": 1.0, "ttft": 0.2, "mat": 1.5}, {"tokens": 36, "latency": 2.0, "ttft": 0.4, "mat": 1.0}]
    row = _summary("tr", 2, done, wall=4.0, prefill_s=1.5)
    assert row["tokens_per_s"] == 25.0  # 100 tokens / 4 s
    assert row["prefill_share"] == pytest.approx(0.375)
    assert row["decode_tokens_per_s"] == 40.0  # 100 tokens / (4 - 1.5) s
    assert row["mat"] == 1.25
    line = format_table([row]).splitlines()[1]
    assert "38%" in line and line.endswith("40.0")


def test_summary_aggregates_draft_sources_of_tr_requests():
    from trserve.bench.concurrency import _done

    class Stats:
        mat, drafted, accepted = 2.0, {"matrix": 6, "context": 4}, {"matrix": 1, "context": 3}

    done = [_done(Stats, 10, 1.0, 0.1, sources=True), _done(Stats, 10, 1.0, 0.1, sources=True)]
    row = _summary("tr", 2, done, wall=2.0, prefill_s=0.5)
    assert row["draft_sources"]["by_source"]["context"] == {"drafted": 8, "accepted": 6, "acceptance": 0.75}
    assert row["draft_sources"]["total"]["drafted"] == 20
    plain = _summary("ar", 2, [_done(Stats, 10, 1.0, 0.1, sources=False)], wall=2.0, prefill_s=0.5)
    assert "draft_sources" not in plain
    assert len(format_table([row, plain]).splitlines()) == 3  # the main table as before
    lines = format_sources([row, plain]).splitlines()
    assert lines[:3] == ["", "", "draft sources: accepted / drafted tokens (acceptance)"]  # a blank line first
    assert lines[3].split() == ["mode", "conc", "matrix", "context", "total"]
    assert lines[4].split() == ["tr", "2", "2/12", "(16.7%)", "6/8", "(75.0%)", "8/20", "(40.0%)"]
    assert len(lines) == 5
    assert format_sources([plain]) == ""


def _config(path, **kw):
    from trserve.bench.concurrency import ConcurrencyConfig

    return ConcurrencyConfig(prompts=str(path), **kw)


def test_conversations_tenants_and_turns(tmp_path):
    import itertools
    import json

    from trserve.bench.concurrency import _follow, _opening, conversations

    path = tmp_path / "p.jsonl"
    rows = [{"question_id": i, "category": cat, "turns": [f"{cat}{i} a", f"{cat}{i} b"]}
            for i, cat in enumerate(["x", "x", "x", "y", "y"])]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # default: first turns only, categories interleaved, 4 tenants in turn (as before)
    plain = conversations(str(path), _config(path))
    assert plain == [("0", ["x0 a"]), ("1", ["y3 a"]), ("2", ["x1 a"]), ("3", ["y4 a"]), ("0", ["x2 a"])]
    # the repetitive workload's way: a tenant per category, every turn
    convs = conversations(str(path), _config(path, all_turns=True, tenant_per_category=True))
    assert [t for t, _ in convs] == ["x", "y", "x", "y", "x"] and convs[0][1] == ["x0 a", "x0 b"]
    feed = itertools.cycle(convs)
    turn = _opening(feed)
    assert turn == ("x", [{"role": "user", "content": "x0 a"}], ["x0 b"])
    second = _follow(feed, turn, "answer")  # the same client asks turn 2 after its own answer
    assert second[0] == "x" and second[2] == []
    assert [m["content"] for m in second[1]] == ["x0 a", "answer", "x0 b"]
    assert [m["role"] for m in second[1]] == ["user", "assistant", "user"]
    assert _follow(feed, second, "done") == ("y", [{"role": "user", "content": "y3 a"}], ["y3 b"])


def test_cli_workload_picks_the_bundled_file_and_prompts_wins(tmp_path):
    import argparse

    from trserve.bench.cli import prompts_of, register
    from trserve.core.datasets import prompt_file

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["bench"])
    assert args.workload == "spec_bench" and prompts_of(args) == str(prompt_file("spec_bench"))
    args = parser.parse_args(["bench", "--workload", "repetitive", "--concurrency", "1"])
    assert prompts_of(args) == str(prompt_file("repetitive"))
    args = parser.parse_args(["bench", "--workload", "mbpp", "--prompts", str(tmp_path / "mine.jsonl")])
    assert prompts_of(args) == str(tmp_path / "mine.jsonl")


def test_repeated_runs_sum_into_one_row_and_each_runs_ratio_is_shown(tmp_path):
    from trserve.bench.concurrency import _merged, format_runs

    def run(tokens, wall):
        return [{"tokens": tokens, "latency": 1.0, "ttft": 0.1, "mat": 1.0}], wall, 0.5

    tr = _merged("tr", 8, [run(100, 2.0), run(100, 4.0)])
    ar = _merged("ar", 8, [run(100, 2.5), run(100, 2.5)])
    assert tr["tokens_per_s"] == 33.33 and tr["runs_tokens_per_s"] == [50.0, 25.0]  # 200 tokens / 6 s
    assert tr["requests"] == 2 and tr["seconds"] == 6.0
    lines = format_runs([tr, ar]).splitlines()
    assert lines[:4] == ["", "", "tr/ar tokens/s per run", " conc  runs"]
    assert lines[4].split() == ["8", "1.25", "0.62", "(min", "0.62)"]  # 50/40 and 25/40
    once = _merged("tr", 8, [run(100, 2.0)])
    assert "runs_tokens_per_s" not in once and format_runs([once, ar]) == ""
    with pytest.raises(ValueError, match="repeats"):
        _config(tmp_path, repeats=0)


def test_one_engine_per_mode_whose_prefix_cache_starts_each_run_empty_with_its_blocks_kept(decoder, tmp_path):
    import torch

    from trserve.bench.concurrency import _engine

    config = _config(tmp_path)
    engines: dict = {}
    tr = _engine(decoder, "tr", config, engines)
    assert _engine(decoder, "tr", config, engines) is tr and _engine(decoder, "ar", config, engines) is not tr
    if tr.prefix is None:
        pytest.skip("no native forward on this host: its engines keep no prefix cache")
    tr.prefix.store("t", list(range(40)), torch.zeros(2, 1, 1, 40, 2))
    allocated = tr.prefix.allocated
    assert len(tr.prefix) == 1 and allocated > 0
    assert _engine(decoder, "tr", config, engines) is tr
    assert len(tr.prefix) == 0 and tr.prefix.bytes == 0 and tr.prefix.allocated == allocated  # blocks kept, free
