"""The light client (issue 30 item 2, issue 46 item 6): clients/python installs into a fresh venv with
grpcio and protobuf only (no torch), writing nothing into its source folder, and calls a running
worker, sync and asyncio: the same ids as the client in this process (the project's editable install
of it), a stream whose chunks add up to the unary answer, finish reasons as strings, `max_tokens`,
the token and plaintext rule, and typed errors (a busy worker's Busy with its retry-after)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trserve_client import Client
from trserve.services.worker.config import Limits, WorkerConfig
from tests.services.worker_harness import serving

REPO = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def worker(decoder):
    limits = Limits(max_new_tokens_cap=256, default_max_new_tokens=16)
    yield from serving(WorkerConfig(port=0, metrics_port=None, max_batch=1, max_queue=0, limits=limits), decoder)


@pytest.fixture(scope="module", params=["3.11", "3.12"])
def client_venv(request, tmp_path_factory) -> Path:
    """A fresh venv with the client installed, on Python 3.11 and 3.12: the interpreter the tests run
    on, and the other where this machine has one."""
    venv = tmp_path_factory.mktemp(f"client-venv-{request.param}")
    if request.param == "%d.%d" % sys.version_info[:2]:
        base = getattr(sys, "_base_executable", sys.executable)  # not the project's venv: a fresh one
    else:
        found = [shutil.which(f"python{request.param}")] + sorted(
            glob.glob(os.path.expanduser(f"~/.pyenv/versions/{request.param}*/bin/python{request.param}")))
        base = next((p for p in found if p and not subprocess.run([p, "--version"], capture_output=True,
                                                                  timeout=60).returncode), None)
        if base is None:  # (a pyenv shim of a version that is not selected fails to run)
            pytest.skip(f"no python{request.param} on this machine")
    version = subprocess.run([base, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    assert version == request.param
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
    source = REPO / "clients" / "python"
    before = sorted(p for p in source.rglob("*") if "__pycache__" not in p.parts)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(source)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    after = sorted(p for p in source.rglob("*") if "__pycache__" not in p.parts)
    assert after == before, f"the install wrote into the source folder: {sorted(set(after) - set(before))}"
    return venv


@pytest.mark.timeout(900)
def test_the_light_client_installs_without_torch_and_calls_a_worker(client_venv, worker) -> None:
    python = str(client_venv / "bin" / "python")
    listed = subprocess.run([python, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            timeout=120)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "trserve-client" in names and {"grpcio", "protobuf"} <= names
    assert not names & {"torch", "numpy", "transformers", "trserve"}, names
    assert subprocess.run([python, "-m", "pip", "show", "torch"], capture_output=True, timeout=120).returncode != 0

    script = textwrap.dedent(f"""
        import asyncio, json, sys
        import grpc
        from trserve_client import AsyncClient, Busy, Client, InvalidArgument, service_config
        out = {{"config": service_config()}}
        with Client({worker.addr!r}, timeout=120) as c:
            r = c.generate(messages={HI!r}, max_tokens=16, mode="ar", return_token_ids=True, logprobs=True,
                           top_logprobs=2)
            out["ids"], out["text"], out["reason"] = r.token_ids, r.text, r.finish_reason
            out["logprob_ids"] = [lp.token_id for lp in r.logprobs]
            chunks = list(c.stream(messages={HI!r}, max_new_tokens=16))
            out["stream_ids"] = [i for ch in chunks for i in ch.token_ids]
            out["stream_text"] = "".join(ch.text for ch in chunks)
            out["finish"] = [ch.finish_reason for ch in chunks]
            out["vocab"] = c.model_info().vocab_size
            try:
                c.generate("", max_new_tokens=4)
            except InvalidArgument as e:  # typed, and still a grpc.RpcError with its code
                out["empty"] = [e.code().name, isinstance(e, grpc.RpcError), bool(e.request_id)]
            # a busy worker (one batch place, no queue): Busy with the server's retry-after
            long = c.stream("Count from one to a thousand:", max_new_tokens=256, mode="ar")
            first = next(iter(long))
            with Client({worker.addr!r}, timeout=60, retries=False) as plain:
                try:
                    plain.generate("Hi", max_new_tokens=2)
                except Busy as e:
                    out["busy"] = [e.code().name, e.retry_after_s]
            long.cancel()
        async def main():
            async with AsyncClient({worker.addr!r}, timeout=120) as a:
                r = await a.generate(messages={HI!r}, max_tokens=16, mode="ar", return_token_ids=True)
                chunks = [ch async for ch in a.stream(messages={HI!r}, max_new_tokens=16, mode="ar")]
                try:
                    await a.generate("", max_new_tokens=4)
                except InvalidArgument as e:
                    empty = e.code().name
                return r.token_ids, [i for ch in chunks for i in ch.token_ids], chunks[-1].finish_reason, empty, \
                    await a.tokenize("hello")
        out["aio"] = asyncio.run(main())
        try:
            Client("10.1.2.3:50051", token="t")
        except ValueError as e:
            out["plaintext"] = str(e)
        out["torch_loaded"] = "torch" in sys.modules
        print(json.dumps(out))
    """)
    run = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=300, cwd=client_venv)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    with Client(worker.addr, timeout=120) as ours:
        reference = ours.generate(messages=HI, max_new_tokens=16, mode="ar", return_token_ids=True)
        vocab = ours.model_info().vocab_size
    from trserve.v1 import generate_pb2 as pb

    reason = pb.FinishReason.Name(reference.raw.finish_reason).removeprefix("FINISH_REASON_").lower()
    assert out["ids"] == list(reference.token_ids) == out["stream_ids"] and out["text"] == reference.text
    assert out["stream_text"] == out["text"] and out["reason"] == reason == out["finish"][-1]
    assert out["logprob_ids"] == out["ids"]
    assert set(out["finish"][:-1]) <= {None}  # only the last chunk finishes
    assert out["empty"] == ["INVALID_ARGUMENT", True, True] and "refusing to send a tenant token" in out["plaintext"]
    assert out["busy"][0] == "RESOURCE_EXHAUSTED" and out["busy"][1] > 0
    aio_ids, aio_stream, aio_reason, aio_empty, hello = out["aio"]
    assert aio_ids == aio_stream == out["ids"] and aio_reason == reason and aio_empty == "INVALID_ARGUMENT"
    assert hello and all(isinstance(i, int) for i in hello)
    assert out["vocab"] == vocab
    assert json.loads(out["config"]) == json.loads((REPO / "clients" / "python" / "trserve_client" / "service_config.json").read_text())
    assert out["torch_loaded"] is False



def test_build_request_sets_ignore_eos_and_min_tokens() -> None:
    """The client's keywords reach the request's own fields (a fixed-length benchmark's ignore_eos; no
    end-of-sequence among the first min_tokens), and stay off by default."""
    from trserve_client import build_request

    req = build_request("Hi", max_new_tokens=8, ignore_eos=True, min_tokens=3)
    assert (req.ignore_eos, req.min_tokens, req.max_new_tokens) == (True, 3, 8)
    plain = build_request("Hi")
    assert (plain.ignore_eos, plain.min_tokens) == (False, 0)


def test_build_request_sets_the_chat_template_fields() -> None:
    """vLLM's chat_template_kwargs (as JSON text on the wire), continue_final_message and
    add_generation_prompt (unset unless given: the server's default, true) go with the messages only."""
    from trserve_client import build_request
    from trserve_client.client import tokenize_request

    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    req = build_request(messages=turns, chat_template_kwargs={"enable_thinking": False},
                        continue_final_message=True, add_generation_prompt=False)
    assert json.loads(req.messages.chat_template_kwargs) == {"enable_thinking": False}
    assert req.messages.continue_final_message and req.messages.HasField("add_generation_prompt")
    assert not req.messages.add_generation_prompt
    plain = build_request(messages=turns).messages
    assert (plain.chat_template_kwargs, plain.continue_final_message, plain.HasField("add_generation_prompt")) == \
        ("", False, False)
    assert tokenize_request(None, turns, chat_template_kwargs={"a": 1}).messages.chat_template_kwargs == '{"a": 1}'
    with pytest.raises(ValueError, match="need messages"):
        build_request("Hi", chat_template_kwargs={"enable_thinking": False})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert json.loads(build_request(messages=turns, tools=[tool]).messages.tools) == [tool]
    assert json.loads(tokenize_request(None, turns, tools=[tool]).messages.tools) == [tool] and plain.tools == ""
    with pytest.raises(ValueError, match="need messages"):
        build_request("Hi", tools=[tool])
