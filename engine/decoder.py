"""The decode loop: Token Recycling (draft -> verify -> accept -> recycle) and plain autoregressive."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from dataclasses import dataclass, field

import torch

from engine.accept import accept_greedy
from engine.acceptance import AcceptanceLog
from engine.config import DecoderConfig
from engine.errors import InvalidArgument
from engine.hybrid import graft, matched_run
from engine.autotune import OnlineTuner, StepPlan
from engine.kv import KVCache
from engine.lookup import ContextLookup
from engine.matrix import AdjacencyMatrix, DraftSource, LocalDraftSource
from engine.model_loader import LoadedModel, load_model
from engine.prompt import PromptBuilder
from engine.recycle import recycle_rows
from engine.sampling import Sampler, SamplingParams, choose, choose_in_tree, new_sampler
from engine.stats import GenerationResult, GenerationStats, StepChunk
from engine.text import StopChecker, TextStream
from engine.tree import CompiledTree, TreeTemplate, get_compiled, load_template
from engine.verify import forward_one, verify_tree

MODES = ("tr", "ar")


@dataclass
class _Run:
    """One generation: its settings and its mutable state."""

    prompt_len: int
    max_new_tokens: int
    stops: StopChecker
    sampler: Sampler | None = None
    log: AcceptanceLog | None = None  # per-step records for the caller's tree optimiser
    tuner: OnlineTuner | None = None  # adaptive tree: plans each step, records exploration steps
    lookup: ContextLookup | None = None  # prompt + output so far, for hybrid drafting
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
        self.autotuner = self._new_autotuner() if config.tree == "adaptive" else None
        best_known = config.tree_for(self.device.type, self.loaded.kernels)
        self.default_tree = self.autotuner.universe if self.autotuner else self.compile(best_known)
        self.eos_ids = self._eos_ids()
        self._lock = threading.Lock()  # one forward stream per Decoder (one model, one device)

    # ---- setup helpers -------------------------------------------------------------------
    def compile(self, tree: str | TreeTemplate) -> CompiledTree:
        """A builtin tree name, a JSON file path, or a TreeTemplate, compiled once for this device."""
        template = tree if isinstance(tree, TreeTemplate) else load_template(tree)
        return get_compiled(template, self.device, self.loaded.dtype)

    def _new_autotuner(self) -> OnlineTuner:
        from engine.calibrate import load_or_measure
        from engine.model_loader import default_cache_dir

        cost = load_or_measure(self.loaded, Path(self.config.cache_dir) if self.config.cache_dir else default_cache_dir())
        return self._tuner(cost)

    def _tuner(self, cost) -> OnlineTuner:
        start = load_template(self.config.tree_for(self.device.type, self.loaded.kernels))
        return OnlineTuner(self.config.autotune, load_template(self.config.autotune.universe), start, cost,
                           self.device, self.loaded.dtype)

    def new_tuner(self) -> OnlineTuner:
        """A fresh online tuner like the Decoder's own (tree "adaptive" only), e.g. one per tenant."""
        if self.autotuner is None:
            raise InvalidArgument('online tuning needs DecoderConfig(tree="adaptive")')
        return self._tuner(self.autotuner.cost)

    @staticmethod
    def tree_name(tree: CompiledTree, tuner: OnlineTuner | None) -> str:
        return f"adaptive:{tuner.current.size}" if tuner is not None else tree.template.name

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
        acceptance: AcceptanceLog | None = None,
        sampling: SamplingParams | None = None,
        tuner: OnlineTuner | None = None,
    ) -> Iterator[StepChunk | GenerationResult]:
        """Yield a StepChunk per decoding step, then the GenerationResult.

        Exactly one of `prompt` (raw text, no chat template), `messages` (chat template applied)
        or `input_ids`. `matrix` is the hot-start state (an AdjacencyMatrix carried across calls,
        or a DraftSource such as the matrix service); None = a fresh zero matrix. `stop_token_ids`
        adds to the model's EOS ids (`ignore_eos` drops those, e.g. for fixed-length benchmarks).
        `cancelled` is polled each step; `deadline` is a time.monotonic() instant after which
        decoding stops with finish_reason "time_limit". `acceptance` collects one record per TR
        step (it must belong to the tree used) for the tree optimiser. `sampling` = None or
        temperature 0 decodes greedily; otherwise tokens are sampled losslessly (engine/sampling.py):
        the same seed gives the same tokens in TR and AR mode, whatever the matrix. `tuner` = an
        online tree tuner of the caller's (e.g. one per tenant, `new_tuner()`) for a request that
        names no tree; default: the Decoder's own when its tree is "adaptive".
        """
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {MODES}, got {mode!r}")
        ids = self.prompts.build(prompt, messages, input_ids)
        tuner = None if tree else (tuner or self.autotuner)
        if tuner is not None:
            compiled = tuner.universe
        else:
            compiled = tree if isinstance(tree, CompiledTree) else (self.compile(tree) if tree else self.default_tree)
        self._check_budget(len(ids), max_new_tokens, compiled)
        stop_ids = (set() if ignore_eos else self.eos_ids) | set(self._check_ids(stop_token_ids or []))
        stops = StopChecker(self.tokenizer, stop_ids, tuple(stop_strings))
        source = self._draft_source(matrix) if mode == "tr" else None
        if acceptance is not None and acceptance.template != compiled.template:
            raise InvalidArgument(f"acceptance log is for tree {acceptance.template.name!r}, "
                                  f"but this request uses {compiled.template.name!r}")
        run = _Run(prompt_len=len(ids), max_new_tokens=max_new_tokens, stops=stops, log=acceptance, tuner=tuner,
                   sampler=new_sampler(sampling, max_new_tokens, self.device))
        with self._lock, torch.inference_mode():
            yield from self._decode(run, ids, source, compiled, cancelled, deadline)

    # ---- validation ----------------------------------------------------------------------
    def _check_ids(self, ids: list[int]) -> list[int]:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise InvalidArgument(f"stop token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return [int(i) for i in ids]

    def _check_budget(self, prompt_len: int, max_new_tokens: int, tree: CompiledTree) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise InvalidArgument(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        room = self.max_context - prompt_len - tree.template.max_width
        if max_new_tokens > room:
            raise InvalidArgument(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model context "
                f"({self.max_context} tokens, {tree.template.max_width} reserved for the draft tree); use max_new_tokens <= {max(room, 0)}"
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
    def _decode(self, run: _Run, ids: list[int], source, tree: CompiledTree, cancelled, deadline):
        t0 = time.perf_counter()
        stops, sampler = run.stops, run.sampler
        cache = KVCache(self.model.config)
        prompt = torch.tensor([ids], device=self.device)
        seed = min(len(ids), self.config.seed_from_prompt) if source else 0
        logits = self.model(input_ids=prompt, past_key_values=cache.cache, use_cache=True,
                            logits_to_keep=max(seed, 1)).logits[0]  # [max(seed, 1), V]
        root = int(choose(logits[-1:], sampler, 0)[0])  # output position 0
        # Prompt seeding: the model's predictions inside this prompt are rows like any recycled ones.
        recycled = recycle_rows(prompt[0, -seed:], logits, self.config.k, list(range(seed))) if seed else None
        text = TextStream(self.tokenizer)
        prefill_s = time.perf_counter() - t0
        session = source.open(tree, self.fingerprint, self.vocab_size, self.config.k) if source else None
        run.lookup = ContextLookup(ids, len(ids) + run.max_new_tokens) if session is not None else None
        try:
            self._commit(run, [root])
            yield StepChunk(tokens=[root], text=text.delta(run.generated, cut=stops.cut_text))
            while run.finish_reason is None:
                if cancelled is not None and cancelled():
                    run.finish_reason = "cancelled"
                    break
                if deadline is not None and time.monotonic() > deadline:
                    run.finish_reason = "time_limit"
                    break
                if session is None:
                    new = self._ar_step(cache, root, sampler, len(run.generated))
                else:
                    new, recycled = self._tr_step(cache, session, recycled, root, tree, run)
                new = self._commit(run, new)
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
        tree_name = self.tree_name(tree, run.tuner) if session else "none"
        stats = GenerationStats.build(run, prefill_s, decode_s, info, tree_name)
        yield GenerationResult(ids=run.generated, text=final_text, finish_reason=run.finish_reason, stats=stats)

    def _commit(self, run: _Run, new: list[int]) -> list[int]:
        """Append what fits (stops, length) and set the finish reason; returns the kept tokens."""
        verdict = run.stops.check(run.generated, new)
        kept = new[: verdict.keep]
        room = run.max_new_tokens - len(run.generated)
        if len(kept) >= room:
            kept = kept[:room]
            run.finish_reason = verdict.reason if verdict.keep <= room and verdict.reason else "length"
        elif verdict.reason:
            run.finish_reason = verdict.reason
        run.generated.extend(kept)
        if run.lookup is not None:
            run.lookup.extend(kept)
        return kept

    def _ar_step(self, cache: KVCache, root: int, sampler: Sampler | None, at: int) -> list[int]:
        return [int(choose(forward_one(self.model, cache, root)[None], sampler, at)[0])]

    def _tr_step(self, cache: KVCache, session, recycled, root: int, tree: CompiledTree, run: _Run):
        drafted = session.step(recycled, root)  # [n_draft] the matrix-drafted tree
        plan = run.tuner.plan() if run.tuner is not None else StepPlan(tree, None, explore=False)
        base = plan.tree
        tokens = drafted if plan.select is None else drafted[plan.select]  # [n] the tree verified this step
        verify, grafted = base, None
        proposal = run.lookup.propose(base.template.lookup)
        if proposal is not None:
            tokens, verify, grafted = graft(tokens, base, proposal.tokens, proposal.ngram)  # [n + chain]
        past = len(cache)
        logits = verify_tree(self.model, cache, tokens, verify)  # [n + chain, V]
        greedy = choose_in_tree(logits, tokens, verify, run.sampler, len(run.generated))  # argmax, or samples
        acc = accept_greedy(tokens, greedy, verify)
        cache.compact(past, acc.path)
        rows = recycle_rows(tokens, logits, self.config.k, acc.path)
        if plan.explore:
            self._record(run.tuner.log, acc, base.n, grafted, past)
            run.tuner.recorded()
        elif run.log is not None:
            self._record(run.log, acc, base.n, grafted, past)
        return acc.tokens, rows

    @staticmethod
    def _record(log: AcceptanceLog, acc, n_base: int, grafted, past: int) -> None:
        deepest = [i for i in acc.path if i < n_base][-1]  # deepest accepted node of the base tree
        if grafted is None:
            log.record(deepest, past)
        else:
            log.record(deepest, past, grafted.ngram, len(grafted.proposal),
                       matched_run(grafted.proposal, acc.tokens), grafted.at)
