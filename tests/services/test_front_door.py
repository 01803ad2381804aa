"""One way in below both edges (issue 58, item 5): a real worker with its gRPC API and its OpenAI HTTP API
on loopback ports, the bundled model. A request's max_tokens, its tenant and its prompt length are each
checked by one function of the front door (services/worker/checks.py), so the refusal reads the same
over gRPC and over HTTP; and no other product code checks them."""

from __future__ import annotations

import ast
import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from trserve.services.openai.server import front_end
from trserve.services.worker.config import Limits, WorkerConfig
from trserve.v1 import generate_pb2 as pb
from trserve.v1 import generate_pb2_grpc
from tests.services.worker_harness import serving

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
LIMITS = Limits(max_new_tokens_cap=256, default_max_new_tokens=8, max_prompt_tokens=64)
MODEL = "door-model"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def worker(decoder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = WorkerConfig(port=0, metrics_port=None, http_port=port, served_model_name=MODEL, limits=LIMITS)
    yield from serving(config, decoder, front_end=front_end)


def over_grpc(worker, tenant: str = "", max_new_tokens: int | None = None, ids: list[int] | None = None
              ) -> tuple[grpc.StatusCode, str]:
    req = pb.GenerateRequest(tenant=tenant)
    if ids is not None:
        req.token_ids.ids.extend(ids)
    else:
        req.messages.messages.extend(pb.ChatMessage(**m) for m in HI)
    if max_new_tokens is not None:
        req.max_new_tokens = max_new_tokens
    with grpc.insecure_channel(worker.addr) as channel:
        try:
            generate_pb2_grpc.GenerateStub(channel).Generate(req, timeout=60)
        except grpc.RpcError as e:
            return e.code(), e.details()
    raise AssertionError("expected the gRPC call to be refused")


def over_http(worker, body: dict, tenant: str | None = None, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"X-Tenant": tenant} if tenant is not None else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{worker.worker.http_port}{path}", method="POST",
                                 data=json.dumps({"model": MODEL, **body}).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60):
            pass
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["error"]
    raise AssertionError("expected the HTTP call to be refused")


@pytest.mark.parametrize("n", [10**6, 257, 0])
def test_max_tokens_is_refused_in_the_same_words(worker, n):
    code, grpc_message = over_grpc(worker, max_new_tokens=n)
    status, error = over_http(worker, {"messages": HI, "max_tokens": n})
    assert code == grpc.StatusCode.INVALID_ARGUMENT and status == 400
    assert error["message"] == grpc_message and grpc_message.startswith("max_new_tokens must be in [1, 256]")
    assert error["param"] == "max_tokens"
    status, error = over_http(worker, {"prompt": "Hi", "max_tokens": n}, path="/v1/completions")
    assert status == 400 and error["message"] == grpc_message


@pytest.mark.parametrize("tenant", ["bad tenant!", "_global", "x" * 65])
def test_an_invalid_tenant_is_refused_in_the_same_words(worker, tenant):
    code, grpc_message = over_grpc(worker, tenant=tenant)
    status, error = over_http(worker, {"messages": HI, "max_tokens": 4}, tenant=tenant)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and status == 400
    assert error["message"] == grpc_message and grpc_message.startswith(f"tenant id {tenant!r} is")
    assert error["param"] == "X-Tenant"


def test_a_prompt_over_the_limit_is_refused_in_the_same_words(worker):
    code, grpc_message = over_grpc(worker, ids=[42] * 65)
    status, error = over_http(worker, {"prompt": [42] * 65, "max_tokens": 4}, path="/v1/completions")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and status == 400
    assert error["message"] == grpc_message == "prompt has 65 tokens; this server accepts at most 64: shorten it"


def _calls(folder: str, name: str) -> set[str]:
    """Product files under `folder` that call `name`."""
    found = set()
    for path in (REPO / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                found.add(str(path.relative_to(REPO)))
    return found


def test_each_limit_has_one_checking_function():
    """max_new_tokens: engine/request/request.py:check_max_new_tokens, called by the engine's request type
    (no cap, for direct engine users) and by the front door's check_call (the server's cap) only; the
    tenant: core/tenants.py:validate_tenant_id, called for a Generate call by the front door only; the
    prompt's tokens: checks.py:check_prompt_length. Neither edge checks them itself."""
    assert _calls("engine", "check_max_new_tokens") == {"engine/request/request.py"}
    assert _calls("services", "check_max_new_tokens") == {"services/worker/checks.py"}
    assert _calls("services/worker", "validate_tenant_id") | _calls("services/openai", "validate_tenant_id") \
        == {"services/worker/checks.py"}
    edges = [*(REPO / "services/openai").rglob("*.py"), REPO / "services/worker/servicer.py",
             REPO / "services/worker/convert.py"]
    for path in edges:
        text = path.read_text()
        assert "max_new_tokens must" not in text and "max_tokens must" not in text, path
        assert "validate_tenant_id" not in text and "check_prompt_length" not in text, path
        readers = {f.name for f in ast.walk(ast.parse(text)) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(f) if isinstance(node, ast.Attribute)
                   and node.attr in ("max_new_tokens_cap", "max_prompt_tokens")}
        assert readers <= {"model_info_to_pb"}, (path, readers)  # ModelInfo reports the limits, checks none
