"""The agent workload's world (bench/agent.py): its tools, run here on data the task file holds, never
on the disk or the network.

The task file (core/data/agent/tasks.json) holds the OpenAI-style `tools`, a key-value `store`, a fake
directory `tree` (a path: its entries), the `shots` every conversation starts with (earlier turns of an
agent's loop: a question, the assistant's call, the tool's result, the answer) and the `tasks`, each a
list of user questions asked one after another in one conversation. The tools:

- `calculator(expression)`: numbers with + - * / // % ** and parentheses (read by `ast`, nothing
  evaluated but arithmetic);
- `lookup(key)`: the store's value;
- `list_files(path)`: the tree's entries of a directory.

A result is a JSON object; a call the tool cannot answer (a key not in the store, an expression that is
not arithmetic) gets one with an "error", which the model reads as an agent's would.

    >>> calculate("(17 + 25) * 3"), calculate("1023 / 3")
    (126, 341)
"""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass
from pathlib import Path

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
       ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64
TYPES = {"string": str, "object": dict, "array": list, "boolean": bool}


class ToolError(ValueError):
    """A call its tool cannot answer (the message goes back to the model as the result's "error")."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression (a whole float as an int, others to 6 decimals)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError("not an arithmetic expression") from None
    try:
        value = _value(tree.body)
    except (ZeroDivisionError, OverflowError) as exc:
        raise ToolError(str(exc)) from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    return round(value, 6) if isinstance(value, float) else value


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponents above {MAX_EXPONENT} are not computed")
        return OPS[type(node.op)](left, right)
    raise ToolError("only numbers, + - * / // % ** and parentheses are computed")


def valid_arguments(schema: dict, value: object) -> bool:
    """Whether `value` follows `schema` in what the bundled tools' schemas say: type, properties,
    required, additionalProperties false, maxLength, enum (a subset of JSON Schema, enough for them)."""
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = kind is None or isinstance(value, TYPES[kind])
    if not ok or ("enum" in schema and value not in schema["enum"]):
        return False
    if isinstance(value, str):
        return len(value) <= schema.get("maxLength", len(value))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if not set(schema.get("required", ())) <= value.keys():
            return False
        if schema.get("additionalProperties") is False and not value.keys() <= props.keys():
            return False
        return all(valid_arguments(props[k], v) for k, v in value.items() if k in props)
    return True


@dataclass(frozen=True)
class AgentWorld:
    """The task file: tools, store, tree, shots and tasks."""

    tools: list[dict]
    store: dict[str, str]
    tree: dict[str, list[str]]
    shots: list[dict]
    tasks: list[dict]  # {"task_id", "questions": [...]}

    @classmethod
    def load(cls, path: str | Path) -> AgentWorld:
        doc = json.loads(Path(path).read_text())
        missing = [k for k in ("tools", "store", "tree", "shots", "tasks") if k not in doc]
        if missing:
            raise ValueError(f"{path}: an agent task file needs {', '.join(missing)} (core/data/agent/tasks.json)")
        for task in doc["tasks"]:
            if not task.get("questions") or not all(isinstance(q, str) for q in task["questions"]):
                raise ValueError(f"{path}: task {task.get('task_id')!r} needs a list of questions")
        return cls(doc["tools"], doc["store"], doc["tree"], doc["shots"], doc["tasks"])

    @property
    def schemas(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"].get("parameters", {}) for t in self.tools}

    def run(self, name: str, arguments: str) -> dict:
        """A parsed call's result (an "error" where the tool cannot answer it)."""
        args = json.loads(arguments)
        try:
            if name not in self.schemas or not valid_arguments(self.schemas[name], args):
                raise ToolError(f"the arguments do not follow the parameters of {name}" if name in self.schemas
                                else f"no tool named {name!r}")
            if name == "calculator":
                return {"expression": args["expression"], "result": calculate(args["expression"])}
            if name == "lookup":
                if args["key"] not in self.store:
                    raise ToolError("no such key")
                return {"key": args["key"], "value": self.store[args["key"]]}
            if name == "list_files":
                path = "/" + args["path"].strip().strip("/")
                if path not in self.tree:
                    raise ToolError("no such directory")
                return {"path": path, "entries": self.tree[path]}
            raise ToolError(f"{name!r} is not run by this bench")
        except ToolError as exc:
            return {**(args if isinstance(args, dict) else {}), "error": str(exc)}
