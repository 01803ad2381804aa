"""Benchmark runner: the same prompts through every decoder, interleaved, in one process.

Decoders: `hf` = transformers `generate` greedy (stock kernels), `pld` = transformers prompt
lookup decoding, `ar` = trserve's own plain decoding (same kernels as TR), `tr` = Token
Recycling as a served worker runs one request: the engine (engine/engine.py) at batch 1, its
default tree (hybrid drafting on CPU) with per-step tree sizes from this host's calibrated forward
costs (engine/drafting/budget/tree.py; calibrated once, cached), `tr-full` = the same engine verifying the
default tree at its full size every step (`Decoder.generate`), `tr-paper` = TR with the paper's 80-node
tree; optional: `tr-matrix` = TR with the matrix-only `cpu-8` tree (no
prompt lookup), `tr-adaptive` = TR re-tuning its tree online (`DecoderConfig(tree="adaptive")`),
`llamacpp` = llama.cpp's plain greedy decoding of the same GGUF through llama-cpp-python (installed
by `make bench-peers`), `llama-server` and `llama-server-ngram` = llama.cpp's own C++ server, plain
and with its n-gram speculation (bench/llama_server.py; `make llama-server` builds it), all
with the same threads, chat-templated prompt ids and token budget.
Each TR decoder keeps one matrix hot across all prompts (after an untimed warm-up), as a served
deployment would. Multi-turn questions ask turn 2 after each decoder's own answer to turn 1.
TR decoders also record their draft tokens per source (GenerationStats.drafted / accepted).
"""

from __future__ import annotations

import itertools
import json
import logging
import platform
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .host import host_facts
from .report import summarise, write_outputs
from ..core.progress import Progress

log = logging.getLogger("trserve.bench")
WARMUP = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]


@dataclass(frozen=True)
class BenchConfig:
    prompts: str
    per_category: int = 1
    max_new_tokens: int = 128
    decoders: tuple[str, ...] = ("hf", "pld", "ar", "tr", "tr-paper")
    tree: str | None = None
    first_turn_only: bool = False
    pld_tokens: int = 10
    model: str | None = None
    threads: int | None = None
    kernels: str = "auto"  # trserve's decoders; hf and pld always run stock transformers
    arithmetic: str = "auto"  # the compressed kernels' arithmetic of trserve's decoders (ModelConfig)
    quantize: str = "auto"  # a checkpoint's linears quantized at load, for trserve's decoders (ModelConfig)
    forward: str = "auto"  # trserve's decoders: auto, native or transformers (engine/model/loader.py)
    gguf: str | None = None  # the llamacpp decoder's weights (default: the bundled model's GGUF)
    json_path: str = "bench-results/bench.json"
    temperature: float = 0.0  # 0 = greedy; > 0 = sampling (top-k/top-p off), the n-th call of every decoder seeded n
    # hot start: first turns of this many further questions per category (the ones after the measured
    # ones, never measured) through every TR decoder first, untimed, so their matrices start as a
    # tenant's would after earlier traffic; 0 = only the one-prompt warm-up (a nearly cold matrix)
    warm_per_category: int = 0

    def __post_init__(self) -> None:
        known = {"hf", "pld", "ar", "tr", "tr-static", "tr-full", "tr-paper", "tr-matrix", "tr-adaptive", "llamacpp",
                 "llama-server", "llama-server-ngram"}
        if not self.decoders or set(self.decoders) - known:
            raise ValueError(f"decoders must be a non-empty subset of {sorted(known)}, got {list(self.decoders)}")
        if self.per_category < 1 or self.max_new_tokens < 1 or self.warm_per_category < 0:
            raise ValueError("per_category and max_new_tokens must be >= 1, warm_per_category >= 0")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not Path(self.prompts).exists():
            raise ValueError(f"prompts file {self.prompts!r} not found")


def select_questions(path: str, per_category: int, skip: int = 0) -> list[dict]:
    """Per category (in file order) its questions skip .. skip + per_category - 1."""
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for line in Path(path).read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            by_cat[q["category"]].append(q)
    return [q for cat in by_cat for q in by_cat[cat][skip : skip + per_category]]


class _HF:
    """transformers `generate`: greedy or sampling, plain or with prompt lookup decoding."""

    def __init__(self, loaded, pld_tokens: int | None, temperature: float) -> None:
        self.loaded, self.pld_tokens, self.temperature = loaded, pld_tokens, temperature
        self.calls = itertools.count()

    def __call__(self, messages, max_new_tokens):
        tok, model = self.loaded.tokenizer, self.loaded.model
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        x = torch.tensor([ids], device=self.loaded.device)
        extra = {"prompt_lookup_num_tokens": self.pld_tokens} if self.pld_tokens else {}
        # explicit top_k/top_p: the model's generation_config may carry others (trserve's are off)
        sample = dict(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0) if self.temperature else {}
        torch.manual_seed(next(self.calls))
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 pad_token_id=tok.eos_token_id, **(sample or {"do_sample": False}), **extra)
        return out[0, len(ids):].tolist(), None


class _TR:
    """trserve's decoders: every request through a BatchEngine (the only decode loop), one at a time
    and stepped in this thread; `ar` and the TR variants differ in mode, tree and engine config."""

    def __init__(self, decoder, engine, mode: str, tree: str | None, temperature: float) -> None:
        self.decoder, self.engine, self.mode, self.tree, self.temperature = decoder, engine, mode, tree, temperature
        self.matrix = decoder.new_tenant() if mode == "tr" else None  # one tenant: its matrix and history
        # the tenant's name in the engine (set to the decoder's name): decoders sharing an engine must not
        # share its prefix cache (one's prompts prefilled, the next one's reused them for free) nor its rates
        self.tenant = ""
        self.calls = itertools.count()

    def __call__(self, messages, max_new_tokens):
        from ..engine import GenerationRequest, SamplingParams

        sampling = SamplingParams(temperature=self.temperature, seed=next(self.calls))
        prepared = self.decoder.prepare(GenerationRequest(messages=messages, max_new_tokens=max_new_tokens,
                                                          mode=self.mode, tree=self.tree, sampling=sampling))
        r = self.engine.generate(prepared, matrix=self.matrix, tenant=self.tenant)
        return r.ids, r.stats


class _LlamaCpp:
    """llama.cpp greedy decoding of a GGUF (llama-cpp-python): the CPU engine users compare with.

    It runs in its own process (spawned once, fed token ids over a pipe): in one process with torch
    and trserve's kernels, llama.cpp's threads compete with the other runtimes' idle-spinning OpenMP
    threads, which measured it 4x slower than alone (20 vs 81 tok/s on 2 cores), an unfair peer.
    Prompts are the same token ids the other decoders get (the chat template applied by the
    transformers tokenizer; the GGUF holds the same vocabulary). Generation stops at the token
    budget or at EOS (kept in the output, as `generate` keeps it). Timed end to end in this process
    like the others (the pipe adds well under a millisecond per prompt). llama.cpp's arithmetic
    differs (8-bit activations), so its outputs are not expected to equal hf's."""

    def __init__(self, gguf: str, tokenizer, threads: int) -> None:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise SystemExit("the llamacpp decoder needs llama-cpp-python: run `make bench-peers` once")
        self.tokenizer, self.gguf, self.threads = tokenizer, gguf, threads
        self.extra_bufts = True  # llama.cpp's default: extra CPU buffer types (AMX, weight repacking)
        self._start()

    def _start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch or OpenMP state inherited
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_llamacpp_worker, args=(child, self.gguf, self.threads, self.extra_bufts),
                                 name="bench-llamacpp", daemon=True)
        self._proc.start()
        child.close()
        try:
            ready = self._conn.recv()
        except EOFError:
            ready = f"its process died (exit code {self._proc.join(5) or self._proc.exitcode})"
        if ready != "ready":
            raise SystemExit(f"llama.cpp did not start: {ready}")

    def __call__(self, messages, max_new_tokens):
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        try:
            self._conn.send((list(ids), int(max_new_tokens)))
            out = self._conn.recv()
        except (EOFError, BrokenPipeError):
            # A crash inside llama.cpp (seen: its AMX matmul segfaults on an AMX-capable Xeon VM, in
            # llama-cpp-python 0.3.36 built with its native defaults): once, start it again without
            # the extra buffer types (AMX and weight repacking) and decode this prompt again.
            self._proc.join(5)
            if not self.extra_bufts:
                raise RuntimeError(f"llama.cpp's process died (exit code {self._proc.exitcode})") from None
            log.warning("llama.cpp's process died (exit code %s); starting it again without its extra CPU buffer "
                        "types (AMX, weight repacking): the llamacpp figures are for that configuration",
                        self._proc.exitcode)
            self.extra_bufts = False
            self._start()
            return self(messages, max_new_tokens)
        if isinstance(out, str):
            raise RuntimeError(f"llama.cpp failed: {out}")
        return out, None

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(timeout=10)


def _llamacpp_worker(conn, gguf: str, threads: int, extra_bufts: bool = True) -> None:
    """The llama.cpp process: load the GGUF, then greedy-decode each (ids, budget) it is sent.
    extra_bufts False: the model without llama.cpp's extra CPU buffer types (`use_extra_bufts` of its
    model parameters, which the Python wrapper does not expose)."""
    try:
        import llama_cpp.llama as wrapper
        from llama_cpp import Llama

        if not extra_bufts:
            defaults = wrapper.llama_cpp.llama_model_default_params

            def no_extra_bufts():
                params = defaults()
                params.use_extra_bufts = False
                return params

            wrapper.llama_cpp.llama_model_default_params = no_extra_bufts

        llm = Llama(model_path=gguf, n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads,
                    verbose=False)
        eos = llm.token_eos()
    except Exception as e:  # noqa: BLE001 - reported to the parent, which stops the bench
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        ids, budget = msg
        try:
            out = []
            for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                out.append(int(tok))
                if tok == eos or len(out) >= budget:
                    break
            conn.send(out)
        except Exception as e:  # noqa: BLE001
            conn.send(f"{type(e).__name__}: {e}")


def _bundled_gguf() -> str:
    import importlib.util

    from ..engine.model.loader import _GGUF_FILE, _GGUF_PACKAGE

    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the llamacpp decoder needs a GGUF: install {_GGUF_PACKAGE} or pass --gguf")
    return str(Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE)


STATIC_TREE = "cpu-hybrid"  # `tr-static`: the static template with lookup chains that was the CPU default


def build_decoders(config: BenchConfig) -> tuple[dict, dict]:
    from ..engine import Decoder, DecoderConfig, ModelConfig, load_model

    model_cfg = ModelConfig(**({"source": config.model} if config.model else {}), threads=config.threads,
                            kernels=config.kernels, forward=config.forward, arithmetic=config.arithmetic,
                            quantize=config.quantize)
    runners, meta = {}, {}
    if {"hf", "pld"} & set(config.decoders):
        stock = load_model(ModelConfig(source=model_cfg.source, kernels="stock", threads=config.threads))
        runners.update({"hf": _HF(stock, None, config.temperature),
                        "pld": _HF(stock, config.pld_tokens, config.temperature)})
    if {"ar", "tr", "tr-static", "tr-full", "tr-paper", "tr-matrix", "tr-adaptive"} & set(config.decoders):
        from ..engine.engine import BatchEngine, EngineConfig
        from ..engine.tuning.cost import engine_cost

        decoder = Decoder(DecoderConfig(model=model_cfg))  # its own engine: one request, whole trees
        tr_tree = config.tree or decoder.default_tree.template.name
        t, whole = config.temperature, decoder.engine
        runners.update({"ar": _TR(decoder, whole, "ar", None, t), "tr-full": _TR(decoder, whole, "tr", tr_tree, t),
                        "tr-paper": _TR(decoder, whole, "tr", "paper", t),
                        "tr-matrix": _TR(decoder, whole, "tr", "cpu-8", t)})
        if {"tr", "tr-static"} & set(config.decoders):  # as a worker serves one request: per-step tree budgets
            served = BatchEngine(decoder, EngineConfig(max_batch=1), engine_cost(decoder, measure=True))
            runners["tr"] = _TR(decoder, served, "tr", tr_tree, t)
            runners["tr-static"] = _TR(decoder, served, "tr", STATIC_TREE, t)
        if "tr-adaptive" in config.decoders:
            adaptive = Decoder(DecoderConfig(model=model_cfg, tree="adaptive"), loaded=decoder.loaded)
            runners["tr-adaptive"] = _TR(adaptive, adaptive.engine, "tr", None, t)
        for name, runner in runners.items():
            if isinstance(runner, _TR):
                runner.tenant = name
        meta.update(fingerprint=decoder.fingerprint, kernels=decoder.loaded.kernels, isa=decoder.loaded.isa,
                    arithmetic=decoder.loaded.arithmetic,
                    forward=decoder.loaded.forward, device=str(decoder.device),
                    trees={"tr": tr_tree, "tr-static": STATIC_TREE, "tr-full": tr_tree, "tr-paper": "paper", "tr-matrix": "cpu-8",
                           "tr-adaptive": "adaptive"})
    peers = [d for d in config.decoders if d == "llamacpp" or d.startswith("llama-server")]
    if peers:
        from transformers import AutoTokenizer

        from .llama_server import LLAMA_CPP_SPEC, ServerDecoder
        from ..engine.model.loader import source_files

        path, file = source_files(model_cfg)
        tok = AutoTokenizer.from_pretrained(path, **file)
        gguf, threads = config.gguf or _bundled_gguf(), config.threads or torch.get_num_threads()
        for name in peers:  # each its own process: no peer reuses another's prompt cache
            runners[name] = _LlamaCpp(gguf, tok, threads) if name == "llamacpp" else ServerDecoder(name, gguf, tok, threads)
        meta["llamacpp"] = LLAMA_CPP_SPEC.split("==")[1]
    return {name: runners[name] for name in config.decoders}, meta


def run_bench(config: BenchConfig) -> dict:
    if config.threads:
        torch.set_num_threads(config.threads)
    questions = select_questions(config.prompts, config.per_category)
    runners, meta = build_decoders(config)
    for name, run in runners.items():  # untimed warm-up (also warms the TR matrices)
        run(WARMUP, 32)
    _warm_matrices(config, runners)
    records = []  # one per (decoder, question, turn)
    with Progress("bench", total=len(questions), unit="prompts", every_s=0.0, logger=log) as progress:
        for q in questions:
            for name, run in runners.items():
                records += _ask(name, run, q, runners, config, progress)
            progress.step(note=q["category"])
    report = summarise(records, list(runners), sampled=config.temperature > 0)
    report["config"] = asdict(config)
    report["environment"] = {
        "model": config.model or "smollm2-135m-instruct", "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "threads": torch.get_num_threads(),
        "python": platform.python_version(), **host_facts(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **meta,
    }
    for name, run in runners.items():  # the llama-server peers: their drafts (n-gram mode), how each ran
        if hasattr(run, "server"):
            report["environment"][name] = {"args": run.server.cmd[3:], "drafted": run.drafted, "accepted": run.accepted}
    if isinstance(runners.get("llamacpp"), _LlamaCpp):  # False: it crashed with them and ran without (see _LlamaCpp)
        report["environment"]["llamacpp_extra_bufts"] = runners["llamacpp"].extra_bufts
    write_outputs(report, records, config.json_path)
    for run in runners.values():
        if hasattr(run, "close"):  # the llama.cpp peers' processes
            run.close()
    return report


def _warm_matrices(config: BenchConfig, runners: dict) -> None:
    """Hot start (config.warm_per_category): the TR decoders answer questions the bench never
    measures, untimed, each with its own matrix, as a served tenant's matrix has seen earlier traffic."""
    warm = select_questions(config.prompts, config.warm_per_category, skip=config.per_category)
    tr = {name: run for name, run in runners.items() if name.startswith("tr")}
    if not warm or not tr:
        return
    with Progress("warming the TR matrices", total=len(warm), unit="prompts", every_s=0.0, logger=log) as progress:
        for q in warm:
            for run in tr.values():
                run([{"role": "user", "content": q["turns"][0]}], config.max_new_tokens)
            progress.step(note=q["category"])


def _ask(name: str, run, q: dict, runners: dict, config: BenchConfig, progress: Progress) -> list[dict]:
    """Every turn of question `q` through one decoder (turn 2 follows its own answer to turn 1)."""
    turns = q["turns"][:1] if config.first_turn_only else q["turns"]
    messages, records = [], []
    for t, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        start = time.perf_counter()
        ids, stats = run(messages, config.max_new_tokens)
        elapsed = time.perf_counter() - start
        progress.add(name, len(ids), elapsed)
        text = _tokenizer(runners).decode(ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        records.append({"decoder": name, "question_id": q["question_id"], "category": q["category"],
                        "turn": t, "ids": ids, "seconds": elapsed, "tokens": len(ids),
                        "steps": stats.steps if stats else None,
                        "step_tokens": sum(stats.accepted_per_step) if stats else None, **_sources(run, stats)})
    return records


def _sources(run, stats) -> dict:
    """A TR decoder's draft tokens per source (GenerationStats.drafted / accepted); nothing for the others."""
    if stats is None or getattr(run, "mode", None) != "tr":
        return {}
    return {"drafted": dict(getattr(stats, "drafted", {})), "accepted": dict(getattr(stats, "accepted", {}))}


def _tokenizer(runners):
    first = next(iter(runners.values()))
    if isinstance(first, _HF):
        return first.loaded.tokenizer
    return first.decoder.tokenizer if isinstance(first, _TR) else first.tokenizer

