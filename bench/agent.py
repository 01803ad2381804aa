"""An agent workload under TR: `trserve bench --agent` (issue 59, item 5).

The bundled task set (core/data/agent/tasks.json: 16 conversations, 36 questions; its tools, a
calculator, a key-value lookup and a file listing of a fake tree, run locally: bench/agent_tools.py)
is played as an agent framework plays it against the OpenAI API. Every model call is a chat
completion with the tools and `tool_choice` "auto", built by the HTTP server's own request parser
(services/openai/convert.py: the tools reach the chat template, the shipped hermes template for the
bundled model, and an opened call is held to the tools' schemas by the grammar) and its reply read by
the server's own parser (services/openai/tools.py:auto_choice). Each parsed call runs locally, its
result goes back as a `tool` message and the conversation continues, until the model answers with
content or the question's turn limit; then the task's next question, in the same conversation. A
conversation starts with the task file's shots, as an agent's history would: three earlier call,
result, answer loops, then three questions answered by a call (the 135M model calls tools once it has
seen calls; with the loops only, it imitates their `<tool_response>` text instead of calling).

Every model call runs in both modes, `tr` and `ar`, on the same messages, the order alternating turn
by turn, each mode its own batching engine and tenant (its own matrix and prefix cache, hot across the
run as one agent's traffic would make them); the conversation goes on with `ar`'s reply. Per mode:
tokens, tok/s, MAT, seconds per turn, the calls opened, parsed and valid against their tool's schema;
`tr`'s ids are compared with `ar`'s on every turn (the lossless contract): any difference is listed
in the report and fails the run. The run's first turn is a warm-up, not counted in the figures.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .agent_tools import AgentWorld, valid_arguments

log = logging.getLogger("trserve.bench")

MODES = ("tr", "ar")
MODEL_ID = "bench"  # the model id the requests name (the parser checks it as a server would)


@dataclass(frozen=True)
class AgentConfig:
    tasks: str  # core/data/agent/tasks.json's format (bench/agent_tools.py)
    limit: int | None = None  # the first N tasks (None: all)
    max_turns: int = 3  # model calls per question (a call, its result, ... until content or this)
    max_new_tokens: int = 128  # per model call
    kernels: str = "auto"
    arithmetic: str = "auto"
    threads: int | None = None
    json_path: str = "bench-results/agent.json"
    model: str | None = None  # `--model` (None: the bundled model)

    def __post_init__(self) -> None:
        if (self.limit is not None and self.limit < 1) or self.max_turns < 1 or self.max_new_tokens < 1:
            raise ValueError("limit (when given), max_turns and max_new_tokens must be >= 1")


@dataclass
class _Run:
    """One run: the decoder, each mode's engine and tenant, the tool format, what was measured."""

    config: AgentConfig
    world: AgentWorld
    decoder: object
    fmt: str  # the served template's tool format (services/openai/toolparse.py)
    engines: dict
    tenants: dict
    rows: dict = field(default_factory=lambda: {mode: [] for mode in MODES})
    turns: int = 0
    tools: dict = field(default_factory=lambda: {"executed": 0, "errors": 0, "answers": 0, "cut_at_turn_limit": 0})
    conversations: list = field(default_factory=list)


def run_agent(config: AgentConfig, decoder=None) -> dict:
    """Play the tasks in both modes; write the JSON report (with every turn's row and conversation) and
    print the table. `decoder`: an engine Decoder already loaded (default: one built from `config`)."""
    run = _open(config, decoder)
    for task in run.world.tasks[:config.limit]:
        messages = [dict(m) for m in run.world.shots]
        for question, text in enumerate(task["questions"]):
            messages.append({"role": "user", "content": text})
            for turn in range(config.max_turns):
                message = _turn(run, messages, {"task_id": task["task_id"], "question": question, "turn": turn})
                messages.append(message)
                if not message.get("tool_calls"):
                    run.tools["answers"] += 1
                    break
                messages += _execute(run, message["tool_calls"])
            else:
                run.tools["cut_at_turn_limit"] += 1
        run.conversations.append({"task_id": task["task_id"], "messages": messages[len(run.world.shots):]})
        log.info("agent: task %s done (%d turns so far)", task["task_id"], run.turns)
    report = _report(run)
    Path(config.json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(config.json_path).write_text(json.dumps({**report, "rows": run.rows, "conversations": run.conversations},
                                                 indent=1))
    print(table(report))
    if report["mismatches"]:
        log.error("agent: tr's ids differ from ar's on %d turns: %s", len(report["mismatches"]), report["mismatches"])
    return report


def _open(config: AgentConfig, decoder) -> _Run:
    from ..engine import Decoder, DecoderConfig
    from ..engine.engine import BatchEngine, EngineConfig
    from ..engine.model.loader import ModelConfig
    from ..services.openai.toolparse import resolve_parser

    if decoder is None:
        decoder = Decoder(DecoderConfig(model=ModelConfig(**({"source": config.model} if config.model else {}),
                                                          kernels=config.kernels, arithmetic=config.arithmetic,
                                                          threads=config.threads)))
    fmt = resolve_parser("auto", decoder.prompts.tool_template)
    if fmt is None:
        raise ValueError("the agent workload needs a chat template with a tool format (hermes, llama3_json or "
                         "mistral); this model's has none")
    engines = {mode: BatchEngine(decoder, EngineConfig(max_batch=1)) for mode in MODES}
    return _Run(config, AgentWorld.load(config.tasks), decoder, fmt, engines,
                {mode: decoder.new_tenant() for mode in MODES})


def _turn(run: _Run, messages: list[dict], where: dict) -> dict:
    """One model call in both modes (the server's parsing of the request and of the reply): the
    assistant message the conversation goes on with (ar's)."""
    from ..services.openai.convert import FINISH, parse_request
    from ..services.openai.tools import auto_choice
    from ..services.worker.checks import check_call
    from ..services.worker.config import Limits

    body = {"model": MODEL_ID, "messages": messages, "tools": run.world.tools, "tool_choice": "auto",
            "temperature": 0, "max_tokens": run.config.max_new_tokens}
    req = parse_request(body, "chat", MODEL_ID, None, run.fmt)
    request = check_call(req.ask, Limits(), "bench").request
    where = {**where, "after_tool": messages[-1]["role"] == "tool", "warm_up": run.turns == 0}
    choices = {}
    for mode in MODES if run.turns % 2 == 0 else MODES[::-1]:  # the modes take turns going first
        prepared = run.decoder.prepare(replace(request, mode=mode))
        t0 = time.perf_counter()
        out = run.engines[mode].generate(prepared, matrix=run.tenants[mode], tenant=mode)
        seconds = time.perf_counter() - t0
        choices[mode] = auto_choice(req.auto, out.text, FINISH[out.finish_reason])
        run.rows[mode].append({**where, **_row(run, out, seconds, choices[mode])})
    run.turns += 1
    if run.rows["tr"][-1]["ids"] != run.rows["ar"][-1]["ids"]:
        log.error("agent: tr != ar on task %s question %s turn %s", where["task_id"], where["question"], where["turn"])
    message = dict(choices["ar"]["message"])
    if not message.get("tool_calls") and message.get("content") is None:
        message["content"] = ""
    return message


def _row(run: _Run, out, seconds: float, choice: dict) -> dict:
    """A mode's figures of one turn, and what its reply called."""
    from ..services.openai.toolparse import OPEN

    s, calls = out.stats, choice["message"].get("tool_calls") or []
    schemas = run.world.schemas
    return {"ids": list(out.ids), "seconds": seconds, "steps": s.steps, "accepted": sum(s.accepted_per_step),
            "prefill_s": s.prefill_s, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
            "finish": choice["finish_reason"], "opened": max(out.text.count(OPEN[run.fmt]), len(calls)),
            "calls": [c["function"] for c in calls],
            "valid": sum(valid_arguments(schemas.get(c["function"]["name"], {}), json.loads(c["function"]["arguments"]))
                         for c in calls),
            "malformed": choice.get("stop_reason") == "malformed_tool_call"}


def _execute(run: _Run, calls: list[dict]) -> list[dict]:
    """Each call run locally: its result as a `tool` message."""
    out = []
    for call in calls:
        result = run.world.run(call["function"]["name"], call["function"]["arguments"])
        run.tools["executed"] += 1
        run.tools["errors"] += "error" in result
        out.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
    return out


def _report(run: _Run) -> dict:
    from .host import host_facts

    tr, ar = run.rows["tr"], run.rows["ar"]
    mismatches = [{k: r[k] for k in ("task_id", "question", "turn")} for r, a in zip(tr, ar) if r["ids"] != a["ids"]]
    tasks = run.world.tasks[:run.config.limit]
    return {"config": run.config.__dict__, "host": host_facts(), "tool_format": run.fmt, "tasks": len(tasks),
            "questions": sum(len(t["questions"]) for t in tasks), "turns": run.turns, "tools": dict(run.tools),
            "modes": {mode: _summary(run.rows[mode], ar) for mode in MODES}, "mismatches": mismatches}


def _summary(rows: list[dict], ar: list[dict]) -> dict:
    timed = [r for r in rows if not r["warm_up"]] or rows  # a one-turn run: its only turn
    tokens, seconds, steps, accepted = (sum(len(r["ids"]) if k == "ids" else r[k] for r in timed)
                                        for k in ("ids", "seconds", "steps", "accepted"))
    return {"turns": len(timed), "tokens": tokens, "seconds": round(seconds, 3),
            "tok_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            "mat": round(accepted / steps, 3) if steps else 0.0, "s_per_turn": round(seconds / len(timed), 4),
            "prefill_s": round(sum(r["prefill_s"] for r in timed), 3),
            "cached_tokens": sum(r["cached_tokens"] for r in timed), "prompt_tokens": sum(r["prompt_tokens"] for r in timed),
            "calls_opened": sum(r["opened"] for r in rows), "calls_parsed": sum(len(r["calls"]) for r in rows),
            "calls_valid": sum(r["valid"] for r in rows), "malformed": sum(r["malformed"] for r in rows),
            "ids_equal_ar": len(rows) == len(ar) and all(r["ids"] == a["ids"] for r, a in zip(rows, ar))}


def table(report: dict) -> str:
    """The report as a readable table (every figure beside the host's ISA flags)."""
    ar, host, t = report["modes"]["ar"]["tok_per_s"], report["host"], report["tools"]
    lines = [f"agent workload (tool_choice auto, {report['tool_format']} calls): {report['tasks']} tasks, "
             f"{report['questions']} questions, {report['turns']} model calls per mode, the first a warm-up "
             f"({host['cpu']}; {' '.join(host['isa_flags'])}; threads {host['threads']})",
             f"{'mode':<6}{'turns':>6}{'tokens':>8}{'tok/s':>9}{'vs ar':>7}{'MAT':>7}{'s/turn':>8}"
             f"{'calls':>7}{'parsed':>8}{'valid':>7}  ids == ar"]
    for name, m in report["modes"].items():
        lines.append(f"{name:<6}{m['turns']:>6}{m['tokens']:>8}{m['tok_per_s']:>9.1f}"
                     f"{m['tok_per_s'] / ar if ar else 0.0:>6.2f}x{m['mat']:>7.2f}{m['s_per_turn']:>8.3f}"
                     f"{m['calls_opened']:>7}{m['calls_parsed']:>8}{m['calls_valid']:>7}  "
                     f"{'yes' if m['ids_equal_ar'] else 'NO'}")
    lines.append(f"calls run locally: {t['executed']} ({t['errors']} answered with an error); answers with "
                 f"content: {t['answers']}; questions cut at the turn limit: {t['cut_at_turn_limit']}")
    if report["mismatches"]:
        lines.append(f"LOSSLESS CHECK FAILED: tr's ids differ from ar's on {len(report['mismatches'])} turns "
                     f"(task, question, turn): {[tuple(m.values()) for m in report['mismatches']]}")
    return "\n".join(lines)
