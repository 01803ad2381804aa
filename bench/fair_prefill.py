"""The fairness workload (issue 56, defect 9): `trserve bench --fair-prefill`.

A real `trserve serve` process (its OpenAI API on loopback). One tenant ("bulk") sends three
concurrent completions of a long prompt (3,236 tokens by default) with echo, logprobs 20 and
max_tokens 0 (prompt scoring, as lm-evaluation-harness asks); while they are in, another tenant
("bystander") streams an 8-token chat. Reported: the bystander's time to first token alone and beside
the bulk prompts (each of `rounds`), and the bulk requests' own latency, with the host's flags.
Before fair prefill the bystander waited 64-70 s on a 2-core Zen 4 (issue 56); the bar is 2 s."""

from __future__ import annotations

import json
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from .host import host_facts, host_line
from ..core.datasets import prompt_file

BYSTANDER = [{"role": "user", "content": "Name a colour."}]


@dataclass(frozen=True)
class FairPrefillConfig:
    prompt_tokens: int = 3236
    bulk: int = 3  # concurrent long completions
    rounds: int = 3
    arithmetic: str = "auto"
    threads: int | None = None
    json_path: str = "bench-results/fair_prefill.json"
    model: str | None = None  # `--model` served (None: the bundled model)


def _serve(config: FairPrefillConfig) -> tuple[subprocess.Popen, str]:
    """`trserve serve` on free ports; its OpenAI base URL."""
    with socket.socket() as s:  # --http-port 0 is "no HTTP API": a free port of its own
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    args = [sys.executable, "-m", "trserve.services.cli", "--log-level", "WARNING", "serve", "--port", "0",
            "--http-port", str(http_port), "--metrics-port", "-1", "--arithmetic", config.arithmetic]
    if config.threads:
        args += ["--threads", str(config.threads)]
    if config.model:
        args += ["--model", config.model]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        m = re.search(r"OpenAI API on (http://\S+)", line)
        if m:
            base = m.group(1).rstrip("/")
            return proc, base if base.endswith("/v1") else base + "/v1"
    raise RuntimeError("trserve serve exited before its OpenAI API listened")


def _post(url: str, body: dict, tenant: str, stream: bool = False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Tenant": tenant})
    return urllib.request.urlopen(req, timeout=900)


def _ttft(base: str, model: str) -> float:
    """Seconds from sending the bystander's streamed chat to its first content."""
    t0 = time.perf_counter()
    body = {"model": model, "messages": BYSTANDER, "max_tokens": 8, "temperature": 0, "stream": True}
    with _post(f"{base}/chat/completions", body, "bystander") as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return time.perf_counter() - t0
    raise RuntimeError("the bystander's stream ended without content")


def _long_prompt(tokens: int, tokenizer_ids) -> list[int]:
    text = " ".join(json.loads(line)["turns"][0] for line in prompt_file("spec_bench").read_text().splitlines() if line)
    ids = tokenizer_ids(text[: 3 * tokens])  # ~4 characters a token: within the server's prompt bound
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def run_fair_prefill(config: FairPrefillConfig) -> dict:
    proc, base = _serve(config)
    try:
        with urllib.request.urlopen(f"{base}/models", timeout=60) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        tokenize = lambda text: json.loads(_post(base.removesuffix("/v1") + "/tokenize", {  # noqa: E731
            "model": model, "prompt": text, "add_special_tokens": False}, "bulk").read())["tokens"]
        ids = _long_prompt(config.prompt_tokens, tokenize)
        alone = [_ttft(base, model) for _ in range(3)]
        rounds = []
        for _ in range(config.rounds):
            bulk_s: list[float] = []

            def bulk() -> None:
                t0 = time.perf_counter()
                body = {"model": model, "prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 0}
                with _post(f"{base}/completions", body, "bulk") as resp:
                    resp.read()
                bulk_s.append(time.perf_counter() - t0)

            threads = [threading.Thread(target=bulk) for _ in range(config.bulk)]
            for t in threads:
                t.start()
            time.sleep(0.5)  # the bulk prompts are in
            beside = _ttft(base, model)
            for t in threads:
                t.join()
            rounds.append({"bystander_ttft_s": round(beside, 3), "bulk_latency_s": [round(s, 2) for s in sorted(bulk_s)]})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report = {"config": asdict(config), "host": host_facts(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "bystander_ttft_alone_s": round(statistics.median(alone), 3), "rounds": rounds,
              "bystander_ttft_beside_max_s": max(r["bystander_ttft_s"] for r in rounds)}
    path = Path(config.json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    lines = [host_line(report["host"]),
             f"fair prefill: {config.bulk} completions of a {config.prompt_tokens}-token prompt (echo, logprobs 20, "
             f"max_tokens 0) from one tenant; another tenant's 8-token chat beside them",
             f"| round | bystander TTFT s | bulk latency s |", "|---|---|---|",
             f"| alone (median of 3) | {report['bystander_ttft_alone_s']:.3f} | |"]
    lines += [f"| {i + 1} | {r['bystander_ttft_s']:.3f} | {', '.join(map(str, r['bulk_latency_s']))} |"
              for i, r in enumerate(rounds)]
    table = "\n".join(lines)
    path.with_suffix(".txt").write_text(table + "\n")
    print(table)
    return report
