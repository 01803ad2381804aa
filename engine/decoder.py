"""The decode loop: Token Recycling (draft -> verify -> accept -> recycle) and plain autoregressive."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from engine.accept import accept_greedy
from engine.config import DecoderConfig
from engine.errors import InvalidArgument
from engine.kv import KVCache
from engine.matrix import AdjacencyMatrix, DraftSource, LocalDraftSource
from engine.model_loader import LoadedModel, load_model
from engine.prompt import PromptBuilder
from engine.recycle import recycle_rows
from engine.stats import GenerationResult, GenerationStats, StepChunk
from engine.text import StopChecker, TextStream
from engine.tree import CompiledTree, get_compiled, load_template
from engine.verify import forward_one, verify_tree

MODES = ("tr", "ar")


@dataclass
class _Run:
    """Mutable state of one generation."""

    prompt_len: int
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class Decoder:
    """Owns model + tokenizer; `generate`/`stream` decode one request at a time per thread-safe lock."""

    def __init__(self, config: DecoderConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.fingerprint = self.loaded.fingerprint
        self.device = self.loaded.device
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_context = config.max_context or int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.prompts = PromptBuilder(self.tokenizer, self.vocab_size)
        self.default_tree = self.compile(config.tree_for(self.device.type))
        self.eos_ids = self._eos_ids()
        self._lock = threading.Lock()  # one forward stream per Decoder (one model, one device)

    # ---- setup helpers -------------------------------------------------------------------
    def compile(self, tree: str) -> CompiledTree:
        return get_compiled(load_template(tree), self.device, self.loaded.dtype)

    def new_matrix(self) -> AdjacencyMatrix:
        return AdjacencyMatrix(self.vocab_size, self.config.k, self.fingerprint, self.device)

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        return ids

    # ---- public API ----------------------------------------------------------------------
    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Decode to the end; see `stream` for the arguments."""
        result = None
        for item in self.stream(prompt, **kwargs):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        input_ids: list[int] | None = None,
        max_new_tokens: int = 128,
        stop_token_ids: list[int] | None = None,
        stop_strings: tuple[str, ...] | list[str] = (),
        ignore_eos: bool = False,
        mode: str = "tr",
        matrix: AdjacencyMatrix | DraftSource | None = None,
        tree: str | CompiledTree | None = None,
        cancelled: Callable[[], bool] | None = None,
        deadline: float | None = None,
    ) -> Iterator[StepChunk | GenerationResult]:
        """Yield a StepChunk per decoding step, then the GenerationResult.

        Exactly one of `prompt` (raw text, no chat template), `messages` (chat template applied)
        or `input_ids`. `matrix` is the hot-start state (an AdjacencyMatrix carried across calls,
        or a DraftSource such as the matrix service); None = a fresh zero matrix. `stop_token_ids`
        adds to the model's EOS ids (`ignore_eos` drops those, e.g. for fixed-length benchmarks).
        `cancelled` is polled each step; `deadline` is a time.monotonic() instant after which
        decoding stops with finish_reason "time_limit".
        """
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {MODES}, got {mode!r}")
        ids = self.prompts.build(prompt, messages, input_ids)
        compiled = tree if isinstance(tree, CompiledTree) else (self.compile(tree) if tree else self.default_tree)
        self._check_budget(len(ids), max_new_tokens, compiled)
        stop_ids = (set() if ignore_eos else self.eos_ids) | set(self._check_ids(stop_token_ids or []))
        stops = StopChecker(self.tokenizer, stop_ids, tuple(stop_strings))
        source = self._draft_source(matrix) if mode == "tr" else None
        with self._lock, torch.inference_mode():
            yield from self._decode(ids, max_new_tokens, stops, source, compiled, cancelled, deadline)

    # ---- validation ----------------------------------------------------------------------
    def _check_ids(self, ids: list[int]) -> list[int]:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise InvalidArgument(f"stop token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return [int(i) for i in ids]

    def _check_budget(self, prompt_len: int, max_new_tokens: int, tree: CompiledTree) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise InvalidArgument(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        room = self.max_context - prompt_len - tree.n
        if max_new_tokens > room:
            raise InvalidArgument(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model context "
                f"({self.max_context} tokens, {tree.n} reserved for the draft tree); use max_new_tokens <= {max(room, 0)}"
                + (" or a shorter prompt" if room <= 0 else "")
            )

    def _draft_source(self, matrix: AdjacencyMatrix | DraftSource | None) -> DraftSource:
        if matrix is None:
            return LocalDraftSource(self.new_matrix())
        if isinstance(matrix, AdjacencyMatrix):
            return LocalDraftSource(matrix)
        if hasattr(matrix, "open"):
            return matrix
        raise InvalidArgument(f"matrix must be an AdjacencyMatrix or a DraftSource, got {type(matrix).__name__}")

    # ---- the loop --------------------------------------------------------------------------
    def _decode(self, ids, max_new_tokens, stops, source, tree, cancelled, deadline):
        t0 = time.perf_counter()
        run = _Run(prompt_len=len(ids), max_new_tokens=max_new_tokens)
        cache = KVCache(self.model.config)
        prompt = torch.tensor([ids], device=self.device)
        seed = min(len(ids), self.config.seed_from_prompt) if source else 0
        logits = self.model(input_ids=prompt, past_key_values=cache.cache, use_cache=True,
                            logits_to_keep=max(seed, 1)).logits[0]  # [max(seed, 1), V]
        root = int(logits[-1].argmax())
        # Prompt seeding: the model's predictions inside this prompt are rows like any recycled ones.
        recycled = recycle_rows(prompt[0, -seed:], logits, self.config.k, list(range(seed))) if seed else None
        text = TextStream(self.tokenizer)
        prefill_s = time.perf_counter() - t0
        session = source.open(tree, self.fingerprint, self.vocab_size, self.config.k) if source else None
        try:
            self._commit(run, [root], stops)
            yield StepChunk(tokens=[root], text=text.delta(run.generated, cut=stops.cut_text))
            while run.finish_reason is None:
                if cancelled is not None and cancelled():
                    run.finish_reason = "cancelled"
                    break
                if deadline is not None and time.monotonic() > deadline:
                    run.finish_reason = "time_limit"
                    break
                if session is None:
                    new = self._ar_step(cache, root)
                else:
                    new, recycled = self._tr_step(cache, session, recycled, root, tree)
                new = self._commit(run, new, stops)
                run.accepted_per_step.append(len(new))
                root = new[-1] if new else root
                if new:
                    yield StepChunk(tokens=new, text=text.delta(run.generated, cut=stops.cut_text))
        finally:
            if session is not None:
                session.close(recycled)
        decode_s = time.perf_counter() - t0 - prefill_s
        final_text = stops.cut_text(self.tokenizer.decode(run.generated, skip_special_tokens=True))
        info = session.info() if session is not None else None
        stats = GenerationStats.build(run, prefill_s, decode_s, info, tree.template.name if session else "none")
        yield GenerationResult(ids=run.generated, text=final_text, finish_reason=run.finish_reason, stats=stats)

    def _commit(self, run: _Run, new: list[int], stops: StopChecker) -> list[int]:
        """Append what fits (stops, length) and set the finish reason; returns the kept tokens."""
        verdict = stops.check(run.generated, new)
        kept = new[: verdict.keep]
        room = run.max_new_tokens - len(run.generated)
        if len(kept) >= room:
            kept = kept[:room]
            run.finish_reason = verdict.reason if verdict.keep <= room and verdict.reason else "length"
        elif verdict.reason:
            run.finish_reason = verdict.reason
        run.generated.extend(kept)
        return kept

    def _ar_step(self, cache: KVCache, root: int) -> list[int]:
        return [int(forward_one(self.model, cache, root).argmax())]

    def _tr_step(self, cache: KVCache, session, recycled, root: int, tree: CompiledTree):
        tokens = session.step(recycled, root)  # [n]
        past = len(cache)
        logits = verify_tree(self.model, cache, tokens, tree)  # [n, V]
        greedy = logits.argmax(dim=-1)  # [n]
        acc = accept_greedy(tokens, greedy, tree)
        cache.compact(past, acc.path)
        rows = recycle_rows(tokens, logits, self.config.k, acc.path)
        return acc.tokens, rows
