"""llama.cpp's own C++ server (`llama-server`) as a bench peer: plain greedy decoding and its n-gram
speculation, on the same GGUF, threads, chat-templated prompt ids and token budget as trserve.

The binary is built once with cmake from the llama.cpp copy inside the llama-cpp-python sdist
(`make llama-server`, or `python -m trserve.bench.llama_server build`: the sdist comes from the
package registry through pip, the build goes to ~/.cache/trserve/llama-server/<version>/), with
llama.cpp's defaults for the host CPU (GGML_NATIVE). Each peer mode is its own server process on a
loopback port, so no mode reuses another's prompt cache; within a mode the server keeps its own
prompt cache across requests, as a deployment of it would (trserve's tenants keep theirs).
Requests go to `POST /completion` with the prompt as token ids, greedy (temperature 0, top-k 1),
and the generated ids come back in `tokens` (`return_tokens`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger("trserve.bench")

LLAMA_CPP_SPEC = "llama-cpp-python==0.3.36"  # the Makefile's bench-peers pin: one llama.cpp for both peers
# The n-gram mode: llama.cpp's simplest self-speculation (the last n tokens looked up in the
# request's own history, the m after the match drafted), with short keys as prompt lookup uses them.
NGRAM_ARGS = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8",
              "--spec-draft-n-max", "8")
MODES = {"llama-server": (), "llama-server-ngram": NGRAM_ARGS}


def server_dir(cache_dir: Path | None = None) -> Path:
    from ..engine.model.paths import default_cache_dir

    version = LLAMA_CPP_SPEC.split("==")[1]
    return Path(cache_dir or default_cache_dir()) / "llama-server" / version


def find_server(cache_dir: Path | None = None) -> Path | None:
    """The built llama-server binary, or None (LLAMA_SERVER names another one)."""
    named = os.environ.get("LLAMA_SERVER")
    if named:
        return Path(named) if Path(named).is_file() else None
    path = server_dir(cache_dir) / "llama-server"
    return path if path.is_file() else None


TOOLS = ("llama-server", "llama-bench", "llama-quantize")  # built together, into server_dir


def find_tool(name: str, cache_dir: Path | None = None) -> Path | None:
    """A built llama.cpp tool of TOOLS (llama-bench, llama-quantize), or None."""
    path = server_dir(cache_dir) / name
    return path if path.is_file() else None


def build_server(cache_dir: Path | None = None, jobs: int | None = None) -> Path:
    """Download the llama-cpp-python sdist (pip), build its llama.cpp's llama-server, llama-bench and
    llama-quantize with cmake (the peers' tools, on the very same sources); llama-server's path.
    Several minutes on 2 cores, once per version."""
    out = server_dir(cache_dir)
    if all((out / tool).is_file() for tool in TOOLS):
        return out / "llama-server"
    if not shutil.which("cmake"):
        raise SystemExit("building llama-server needs cmake (and a C++ compiler)")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        subprocess.run([_python(), "-m", "pip", "download", LLAMA_CPP_SPEC, "--no-binary", ":all:", "--no-deps",
                        "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("*/vendor/llama.cpp"))
        build = Path(tmp) / "build"
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON"]
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *flags], check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(jobs or os.cpu_count() or 1)],
                       check=True)
        for tool in TOOLS:
            shutil.copy2(build / "bin" / tool, out / f"{tool}.tmp")
            os.replace(out / f"{tool}.tmp", out / tool)
    return out / "llama-server"


def _python() -> str:
    import sys

    return sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process on a loopback port: `complete(ids, budget)` -> generated ids."""

    def __init__(self, binary: Path, gguf: str, threads: int, extra: tuple[str, ...] = (), parallel: int = 1,
                 ctx_per_slot: int = 4096) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary), "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
               "-c", str(ctx_per_slot * parallel), "--host", "127.0.0.1", "--port", str(self.port), "--no-webui",
               "-lv", "1", *extra]
        self.cmd = cmd
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not become ready in {timeout_s:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-800:]

    def _request(self, ids: list[int], max_new_tokens: int, stream: bool) -> urllib.request.Request:
        """POST /completion: greedy, the prompt as token ids, the generated ids returned."""
        body = json.dumps({"prompt": [int(i) for i in ids], "n_predict": int(max_new_tokens), "temperature": 0.0,
                           "top_k": 1, "cache_prompt": True, "stream": stream, "return_tokens": True}).encode()
        return urllib.request.Request(self.url + "/completion", data=body, headers={"Content-Type": "application/json"})

    def complete(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        """Greedy tokens after the prompt `ids` (at most `max_new_tokens`; the server stops at EOS) and
        the server's timings (drafted / accepted counts in n-gram mode)."""
        req = self._request(ids, max_new_tokens, stream=False)
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
        except urllib.error.URLError as e:
            raise RuntimeError(f"llama-server failed ({e}); its log: {self._tail()}") from e
        return [int(t) for t in out.get("tokens", [])], out.get("timings", {})

    def stream(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, dict]:
        """As `complete`, streamed: (ids, seconds to the first generated token, the server's timings)."""
        req = self._request(ids, max_new_tokens, stream=True)
        t0, ttft, tokens, timings = time.perf_counter(), None, [], {}
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                for raw in r:  # server-sent events: "data: {...}" lines
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[len("data: "):])
                    if event.get("tokens"):
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        tokens += [int(t) for t in event["tokens"]]
                    if event.get("stop"):
                        timings = event.get("timings", {})
                        break
        except urllib.error.URLError as e:
            raise RuntimeError(f"llama-server failed ({e}); its log: {self._tail()}") from e
        return tokens, ttft if ttft is not None else time.perf_counter() - t0, timings

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="build llama.cpp's llama-server for the bench peers")
    p.add_argument("command", choices=["build", "path"])
    p.add_argument("--jobs", type=int, default=None)
    args = p.parse_args(argv)
    if args.command == "build":
        print(build_server(jobs=args.jobs))
    else:
        found = find_server()
        if found is None:
            raise SystemExit("llama-server is not built: make llama-server")
        print(found)


if __name__ == "__main__":
    main()


def start_mode(mode: str, gguf: str, threads: int, parallel: int = 1) -> LlamaServer:
    """A llama-server of peer `mode` (MODES) with `parallel` slots, with llama.cpp's defaults; where it
    crashes while starting (seen: a segfault in its extra CPU buffer types, AMX and weight repacking,
    on an AMX-capable Xeon VM, as llama-cpp-python's did there), once more with `--no-repack`, logged
    and kept in its command line (the report's environment shows it)."""
    binary = find_server()
    if binary is None:
        raise SystemExit(f"the {mode} peer needs llama.cpp's server: run `make llama-server` once")
    try:
        return LlamaServer(binary, gguf, threads, MODES[mode], parallel=parallel)
    except RuntimeError as e:
        log.warning("llama-server (%s) failed to start (%s); starting it again with --no-repack: its figures are "
                    "for that configuration", mode, str(e).splitlines()[0])
        return LlamaServer(binary, gguf, threads, (*MODES[mode], "--no-repack"), parallel=parallel)


def tokens_per_forward(timings: dict, tokens: int) -> float:
    """A request's tokens per target forward in n-gram mode (each accepted draft token saved one), 1.0 plain."""
    accepted = int(timings.get("draft_n_accepted", 0) or 0)
    return tokens / max(tokens - accepted, 1) if tokens else 1.0


class ServerDecoder:
    """A bench decoder on a llama-server of one mode: chat-templated prompt ids in, generated ids out."""

    def __init__(self, mode: str, gguf: str, tokenizer, threads: int) -> None:
        self.mode, self.tokenizer = mode, tokenizer
        self.server = start_mode(mode, gguf, threads)
        self.drafted = self.accepted = 0

    def __call__(self, messages, max_new_tokens):
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        out, timings = self.server.complete(list(ids), max_new_tokens)
        self.drafted += int(timings.get("draft_n", 0) or 0)
        self.accepted += int(timings.get("draft_n_accepted", 0) or 0)
        return out, None

    def close(self) -> None:
        self.server.close()
