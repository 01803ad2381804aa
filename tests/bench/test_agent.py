"""The agent workload (`trserve bench --agent`, issue 59 item 5): its local tools on the bundled data,
and a slice of it with the real bundled model, where tr's ids must equal ar's on every turn, the model's
calls must be parsed by the server's parser, run here, and their results fed back to it."""

from __future__ import annotations

import json

import pytest

from trserve.bench.agent import MODES, AgentConfig, run_agent, table
from trserve.bench.agent_tools import AgentWorld, calculate, valid_arguments
from trserve.core.datasets import agent_file

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def world() -> AgentWorld:
    return AgentWorld.load(agent_file())


def test_the_shots_show_what_the_tools_compute(world):
    """Every shot's tool result is what the bench's tool returns for that call (the few-shot history
    the model reads is the same world it then calls into)."""
    pairs = [(world.shots[i - 1]["tool_calls"][0]["function"], m) for i, m in enumerate(world.shots)
             if m["role"] == "tool"]
    assert {f["name"] for f, _ in pairs} == set(world.schemas) == {"calculator", "lookup", "list_files"}
    for f, m in pairs:
        assert world.run(f["name"], f["arguments"]) == json.loads(m["content"])
    assert len(world.tasks) >= 12 and all(t["questions"] for t in world.tasks)


def test_tools_answer_from_the_data_and_refuse_what_they_cannot_compute(world):
    assert calculate("(17 + 25) * 3") == 126 and calculate("129.90 * 2") == 259.8 and calculate("-2 ** 3") == -8
    assert world.run("calculator", '{"expression": "1 / 0"}')["error"] == "division by zero"
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "[1] * 3"):
        assert "error" in world.run("calculator", json.dumps({"expression": bad})), bad
    assert world.run("lookup", '{"key": "price-widget"}') == {"key": "price-widget", "value": "4.50"}
    assert world.run("lookup", '{"key": "price-unobtainium"}')["error"] == "no such key"
    assert world.run("list_files", '{"path": "/src/utils/"}')["entries"] == ["dates.py", "money.py"]
    assert "error" in world.run("list_files", '{"path": "/etc"}')
    assert "error" in world.run("list_files", '{"path": 3}') and "error" in world.run("lookup", '{"k": "x"}')


def test_valid_arguments_reads_the_schemas_the_tools_use(world):
    schema = world.schemas["lookup"]
    assert valid_arguments(schema, {"key": "a"})
    assert not valid_arguments(schema, {"key": "a" * 49})  # maxLength 48
    assert not valid_arguments(schema, {})  # required
    assert not valid_arguments(schema, {"key": "a", "other": 1})  # additionalProperties false
    assert not valid_arguments(schema, {"key": 1}) and not valid_arguments(schema, "a")
    assert valid_arguments({"type": "integer", "enum": [1, 2]}, 2) and not valid_arguments({"type": "integer"}, True)


def test_a_slice_with_the_bundled_model_is_lossless_and_feeds_results_back(decoder, tmp_path):
    path = tmp_path / "agent.json"
    report = run_agent(AgentConfig(tasks=str(agent_file()), limit=2, max_turns=2, max_new_tokens=48,
                                   json_path=str(path)), decoder=decoder)
    written = json.loads(path.read_text())
    rows = written["rows"]
    # tr == ar on every turn, both modes on the same turns
    assert len(rows["tr"]) == len(rows["ar"]) == report["turns"] >= 4
    for tr, ar in zip(rows["tr"], rows["ar"]):
        assert [tr[k] for k in ("task_id", "question", "turn")] == [ar[k] for k in ("task_id", "question", "turn")]
        assert tr["ids"] == ar["ids"], (tr["task_id"], tr["question"], tr["turn"])
    assert report["mismatches"] == [] and all(report["modes"][m]["ids_equal_ar"] for m in MODES)
    # the model called: the server's parser read the calls, each valid against its tool's schema, run here
    ar = report["modes"]["ar"]
    assert ar["calls_parsed"] >= 1 and ar["calls_valid"] == ar["calls_parsed"] == report["modes"]["tr"]["calls_parsed"]
    assert report["tools"]["executed"] >= 1
    # ... and their results went back: a tool message after each call turn, and a model turn reading it
    fed = [r for r in rows["ar"] if r["after_tool"]]
    assert fed and all(r["prompt_tokens"] > 0 for r in fed)
    messages = [m for c in written["conversations"] for m in c["messages"]]
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            results = messages[i + 1:i + 1 + len(m["tool_calls"])]
            assert [r["role"] for r in results] == ["tool"] * len(m["tool_calls"])
            assert [r["tool_call_id"] for r in results] == [c["id"] for c in m["tool_calls"]]
            for call, result in zip(m["tool_calls"], results):
                assert json.loads(result["content"]) == AgentWorld.load(agent_file()).run(
                    call["function"]["name"], call["function"]["arguments"])
    # the report's fields, and a TR step that accepted more than one token somewhere in the slice
    for mode in MODES:
        m = report["modes"][mode]
        assert {"tokens", "tok_per_s", "mat", "s_per_turn", "turns", "calls_opened", "calls_parsed", "calls_valid",
                "prefill_s", "cached_tokens"} <= m.keys() and m["tokens"] > 0 and m["s_per_turn"] > 0
    assert report["modes"]["ar"]["mat"] == 1.0 and report["modes"]["tr"]["mat"] > 1.0
    assert "ids == ar" in table(report) and "FAILED" not in table(report)


def test_a_mismatch_is_reported_loudly():
    report = {"tool_format": "hermes", "tasks": 1, "questions": 1, "turns": 1,
              "host": {"cpu": "x", "isa_flags": [], "threads": 1},
              "tools": {"executed": 0, "errors": 0, "answers": 1, "cut_at_turn_limit": 0},
              "modes": {m: {"turns": 1, "tokens": 3, "tok_per_s": 1.0, "mat": 1.0, "s_per_turn": 1.0, "calls_opened": 0,
                            "calls_parsed": 0, "calls_valid": 0, "ids_equal_ar": m == "ar"} for m in MODES},
              "mismatches": [{"task_id": 1, "question": 0, "turn": 0}]}
    text = table(report)
    assert "LOSSLESS CHECK FAILED" in text and "(1, 0, 0)" in text and " NO" in text
