"""`trserve serve` and `trserve generate` as real processes; the StoreDraftSource fallback; admission."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trserve.core.errors import Unavailable
from trserve.core.model_spec import ModelSpec
from trserve.matrix_store import MatrixStore, StoreConfig
from trserve_client import Client
from trserve.services.worker.admission import Admission, QueueFull
from trserve.services.worker.drafting.embedded import StoreDraftSource
from trserve.v1 import generate_pb2 as pb

REPO = Path(__file__).resolve().parents[3]


def trserve(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trserve.services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, **kwargs)


@pytest.mark.timeout(300)
def test_serve_and_generate_cli(tmp_path):
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "trserve.services.cli", "serve", "--port", "0", "--metrics-port", "-1",
                               "--http-port", "0", "--grace", "30"], cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = server.stdout.readline()
        assert line.startswith("trserve listening on 127.0.0.1:"), (line, (tmp_path / "serve.log").read_text())
        addr = line.split()[-1]

        # a question whose answer is no near-tie for this small model in either arithmetic (France's is:
        # "The" 0.08 above "L" in the exact model's log-probabilities, and int8 picks "L'Étoile")
        out = trserve("generate", "--addr", addr, "--max-new-tokens", "16", "What is the capital of Germany?")
        assert out.returncode == 0, out.stderr
        assert "Berlin" in out.stdout
        assert "tokens in" in out.stderr and "MAT" in out.stderr and "finish" in out.stderr

        streamed = trserve("generate", "--addr", addr, "--stream", "--max-new-tokens", "16", "What is the capital of Germany?")
        assert streamed.returncode == 0 and streamed.stdout == out.stdout

        as_json = trserve("generate", "--addr", addr, "--json", "--raw", "--max-new-tokens", "4", "Hello, my name is")
        reply = json.loads(as_json.stdout)
        assert reply["finish_reason"] == "FINISH_REASON_LENGTH" and len(reply["token_ids"]) == 4

        bad = trserve("generate", "--addr", addr, "--max-new-tokens", "0", "Hi")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "max_new_tokens" in bad.stderr

        with Client(addr, timeout=60) as client:  # SIGTERM drains: the in-flight stream completes
            chunks = client.stream(messages=[{"role": "user", "content": "Count from one to twenty."}], max_new_tokens=24)
            first = next(chunks)
            server.send_signal(signal.SIGTERM)
            rest = list(chunks)
        assert rest[-1].raw.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == rest[-1].stats.generated_tokens
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()


def test_generate_cli_without_server():
    out = trserve("generate", "--addr", "127.0.0.1:1", "--timeout", "5", "Hello")
    assert out.returncode == 1 and "cannot reach trserve at 127.0.0.1:1" in out.stderr


def test_generate_cli_without_the_client_installed_says_how_to_install_it(monkeypatch, capsys):
    """`pip install .` alone does not bring the client (clients/python): the commands that call through
    it say so in one line, not with a traceback."""
    from trserve.services.cli import main

    monkeypatch.setitem(sys.modules, "trserve_client", None)  # as if it were not installed
    assert main(["generate", "--addr", "127.0.0.1:1", "Hello"]) == 2
    err = capsys.readouterr().err
    assert "trserve generate: needs the Python client" in err and "pip install ./clients/python" in err


class _FailingStore(MatrixStore):
    """The embedded store with apply() failing, as a dead backend would."""

    def apply(self, *args, **kwargs):
        raise Unavailable("store is down")

    def apply_versioned(self, *args, **kwargs):
        raise Unavailable("store is down")


def test_store_failure_falls_back_to_local_drafting(decoder):
    store = _FailingStore(StoreConfig())
    spec = ModelSpec(decoder.fingerprint, decoder.vocab_size, decoder.config.k)
    reference = decoder.generate("Hello, my name is", max_new_tokens=8, mode="ar")
    result = decoder.generate("Hello, my name is", max_new_tokens=8, matrix=StoreDraftSource(store, spec, "t", None))
    assert result.ids == reference.ids
    assert result.stats.draft_mode == "local-fallback"
    assert store.checkout(spec, "t").version == 0


def test_admission_bounds_the_queue():
    async def scenario():
        admission = Admission(max_active=1, max_queue=1)
        entered = asyncio.Event()
        release = asyncio.Event()

        async def hold():
            async with admission.slot():
                entered.set()
                await release.wait()

        first = asyncio.create_task(hold())
        await entered.wait()
        second = asyncio.create_task(hold())
        await asyncio.sleep(0)
        assert (admission.active, admission.waiting) == (1, 1)
        with pytest.raises(QueueFull) as e:
            async with admission.slot():
                pass
        assert e.value.retry_after_s > 0
        with pytest.raises(QueueFull):
            admission.try_admit()  # the same answer without queueing
        release.set()
        await asyncio.gather(first, second)
        assert (admission.active, admission.waiting) == (0, 0)

    asyncio.run(scenario())
    gate = Admission(max_active=1, max_queue=1, max_calls=2)
    with gate.call(), gate.call():
        with pytest.raises(QueueFull, match="max_concurrent_rpcs=2"):
            with gate.call():
                pass
    assert gate.calls == 0


def test_full_trees_flag_turns_batch_aware_sizing_off():
    from trserve.services.cli import build_parser
    from trserve.services.node.cli import build_configs

    default, _ = build_configs(build_parser().parse_args(["serve"]))
    full, _ = build_configs(build_parser().parse_args(["serve", "--full-trees"]))
    assert default.engine_config().batch_aware is True
    assert full.full_trees and full.engine_config().batch_aware is False
