"""The decode loop: Token Recycling (draft -> verify -> accept -> recycle) and plain autoregressive.

One `Generate` is `Decoder.prepare` (validate against the model, once) then `Decoder.stream`
(prefill, then one step per iteration until a finish reason is set).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from core.errors import InvalidArgument
from core.model_spec import ModelSpec
from engine.config import DecoderConfig
from engine.model.loader import LoadedModel, load_model
from engine.model.runner import ModelRunner, RowInput, quiet_torch_threads, uses_kernel_pool
from engine.request.prompt import PromptBuilder, check_token_ids
from engine.request.request import GenerationRequest, PreparedRequest
from engine.request.stops import StopChecker
from engine.request.text import TextStream
from engine.results import GenerationResult, GenerationStats, StepChunk
from engine.sequence import Sequence
from engine.step import accept_step, draft_step
from engine.tr.lookup import ContextLookup
from engine.tr.matrix import AdjacencyMatrix
from engine.tr.recycle import recycle_rows
from engine.tr.sampling import choose, new_sampler
from engine.tr.source import DraftSource, LocalDraftSource
from engine.tr.tree import CompiledTree, TreeTemplate, get_compiled, load_template
from engine.tuning.online import OnlineTuner, StepPlan
from engine.tuning.records import AcceptanceLog


class Decoder:
    """Owns model + tokenizer; `generate`/`stream` decode one request at a time (a lock: one model,
    one forward stream)."""

    def __init__(self, config: DecoderConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.fingerprint = self.loaded.fingerprint
        self.device = self.loaded.device
        self.vocab_size = int(self.model.config.vocab_size)
        self.spec = ModelSpec(self.fingerprint, self.vocab_size, config.k)
        self.max_context = config.max_context or int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.prompts = PromptBuilder(self.tokenizer, self.vocab_size)
        self.autotuner = self._new_autotuner() if config.tree == "adaptive" else None
        best_known = config.tree_for(self.device.type, self.loaded.kernels)
        self.default_tree = self.autotuner.universe if self.autotuner else self.compile(best_known)
        self.eos_ids = self._eos_ids()
        # One forward at a time on this model, whoever runs it (this decoder's own loop or a
        # BatchEngine's step): the attention function's per-forward mask cache is process state.
        self.model_lock = threading.Lock()
        self._runner: ModelRunner | None = None  # one KV row, reused by every serial generation
        self._kernel_pool = uses_kernel_pool(self.model)  # decode loops keep torch single-threaded

    # ---- setup helpers -------------------------------------------------------------------
    def compile(self, tree: str | TreeTemplate) -> CompiledTree:
        """A builtin tree name, a JSON file path, or a TreeTemplate, compiled once for this device."""
        template = tree if isinstance(tree, TreeTemplate) else load_template(tree)
        self._check_ranks(template)
        return get_compiled(template, self.device, self.loaded.dtype)

    def _check_ranks(self, template: TreeTemplate) -> None:
        """A node of rank r reads successor r of its parent's row: r must be < K."""
        if template.max_rank >= self.config.k:
            raise InvalidArgument(f"tree {template.name!r} uses successor rank {template.max_rank} but the matrix "
                                  f"keeps K={self.config.k} per token; use a tree with ranks < {self.config.k}")

    def _new_autotuner(self) -> OnlineTuner:
        from engine.model.paths import default_cache_dir
        from engine.tuning.calibrate import load_or_measure

        cost = load_or_measure(self.loaded, Path(self.config.cache_dir) if self.config.cache_dir else default_cache_dir())
        return self._tuner(cost)

    def _tuner(self, cost) -> OnlineTuner:
        start = load_template(self.config.tree_for(self.device.type, self.loaded.kernels))
        universe = load_template(self.config.autotune.universe)
        self._check_ranks(universe)
        return OnlineTuner(self.config.autotune, universe, start, cost, self.device, self.loaded.dtype)

    def new_tuner(self) -> OnlineTuner:
        """A fresh online tuner like the Decoder's own (tree "adaptive" only), e.g. one per tenant."""
        if self.autotuner is None:
            raise InvalidArgument('online tuning needs DecoderConfig(tree="adaptive")')
        return self._tuner(self.autotuner.cost)

    @staticmethod
    def tree_name(tree: CompiledTree, tuner: OnlineTuner | None) -> str:
        return f"adaptive:{tuner.current.size}" if tuner is not None else tree.template.name

    def new_matrix(self) -> AdjacencyMatrix:
        return AdjacencyMatrix(self.spec, self.device)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        return frozenset(ids)

    # ---- validation: once per request --------------------------------------------------------
    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Check a request against this model: prompt ids, tree (ranks < K), context budget, stop ids."""
        ids = self.prompts.build(request.prompt, request.messages, request.input_ids)
        tree = None
        if request.mode == "tr":
            tree = self._resolve_tree(request.tree) if request.tree is not None else self.default_tree
        self._check_budget(len(ids), request.max_new_tokens, tree)
        stop_ids = frozenset(check_token_ids(request.stop_token_ids, self.vocab_size, "stop token ids"))
        return PreparedRequest(request, tuple(ids), tree, stop_ids | (frozenset() if request.ignore_eos else self.eos_ids))

    def _resolve_tree(self, tree: str | TreeTemplate | CompiledTree) -> CompiledTree:
        if isinstance(tree, CompiledTree):
            self._check_ranks(tree.template)
            return tree
        return self.compile(tree)

    def _check_budget(self, prompt_len: int, max_new_tokens: int, tree: CompiledTree | None) -> None:
        reserved = tree.template.max_width if tree is not None else self.default_tree.template.max_width
        room = self.max_context - prompt_len - reserved
        if max_new_tokens > room:
            raise InvalidArgument(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model context "
                f"({self.max_context} tokens, {reserved} reserved for the draft tree); use max_new_tokens <= {max(room, 0)}"
                + (" or a shorter prompt" if room <= 0 else "")
            )

    # ---- public API ----------------------------------------------------------------------
    def generate(self, request: GenerationRequest | str | None = None, /, *,
                 matrix: AdjacencyMatrix | DraftSource | None = None, cancelled: Callable[[], bool] | None = None,
                 deadline: float | None = None, acceptance: AcceptanceLog | None = None,
                 tuner: OnlineTuner | None = None, **fields) -> GenerationResult:
        """Decode to the end. `request` is a GenerationRequest, or built from `fields` (its field
        names; a positional str is the raw `prompt`). See `stream` for the rest."""
        if not isinstance(request, GenerationRequest):
            request = GenerationRequest(prompt=request, **fields) if request is not None else GenerationRequest(**fields)
        elif fields:
            raise InvalidArgument(f"give a GenerationRequest or its fields, not both (got {sorted(fields)})")
        result = None
        for item in self.stream(request, matrix=matrix, cancelled=cancelled, deadline=deadline,
                                acceptance=acceptance, tuner=tuner):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

    def stream(self, request: GenerationRequest | PreparedRequest, *,
               matrix: AdjacencyMatrix | DraftSource | None = None, cancelled: Callable[[], bool] | None = None,
               deadline: float | None = None, acceptance: AcceptanceLog | None = None,
               tuner: OnlineTuner | None = None) -> Iterator[StepChunk | GenerationResult]:
        """Yield a StepChunk per decoding step, then the GenerationResult.

        `request` as from `prepare` (a GenerationRequest is prepared here). `matrix` is the hot-start
        state (an AdjacencyMatrix carried across calls, or a DraftSource such as the matrix
        service); None = a fresh zero matrix. `cancelled` is polled each step; `deadline` is a
        time.monotonic() instant after which decoding stops with finish_reason "time_limit".
        `acceptance` collects one record per TR step (it must belong to the tree used) for the tree
        optimiser. `tuner` = an online tree tuner of the caller's (e.g. one per tenant,
        `new_tuner()`) for a request that names no tree; default: the Decoder's own when its tree
        is "adaptive".
        """
        prepared = request if isinstance(request, PreparedRequest) else self.prepare(request)
        req = prepared.request
        tuner = (tuner or self.autotuner) if req.uses_default_tree else None
        tree = tuner.universe if tuner is not None else prepared.tree
        if acceptance is not None and tree is not None and acceptance.template != tree.template:
            raise InvalidArgument(f"acceptance log is for tree {acceptance.template.name!r}, "
                                  f"but this request uses {tree.template.name!r}")
        source = self.draft_source(matrix) if req.mode == "tr" else None
        seq = Sequence(prepared, StopChecker(self.tokenizer, set(prepared.stop_ids), req.stop_strings),
                       new_sampler(req.sampling, req.max_new_tokens, self.device), acceptance, tuner)
        with self.model_lock, torch.inference_mode(), quiet_torch_threads(self._kernel_pool):
            yield from self._decode(seq, source, tree, cancelled, deadline)

    def draft_source(self, matrix: AdjacencyMatrix | DraftSource | None) -> DraftSource:
        if matrix is None:
            return LocalDraftSource(self.new_matrix())
        if isinstance(matrix, AdjacencyMatrix):
            return LocalDraftSource(matrix)
        if hasattr(matrix, "open"):
            return matrix
        raise InvalidArgument(f"matrix must be an AdjacencyMatrix or a DraftSource, got {type(matrix).__name__}")

    # ---- the loop --------------------------------------------------------------------------
    def runner(self) -> ModelRunner:
        """The serial loop's model runner (one KV row; the same forward as the batching engine's)."""
        if self._runner is None:
            self._runner = ModelRunner(self.model, 1, self.loaded.dtype, native=self.loaded.native, topk=self.config.k,
                                       batch_step=self.loaded.batch_step)
        return self._runner

    def _decode(self, seq: Sequence, source: DraftSource | None, tree: CompiledTree | None, cancelled, deadline):
        t0 = time.perf_counter()
        ids = list(seq.prepared.ids)
        runner = self.runner()
        runner.kv.reset()
        row = runner.kv.open_row()
        prompt = torch.tensor(ids, device=self.device)
        seed = min(len(ids), self.config.seed_from_prompt) if source else 0
        keep = max(seed, 1)
        need = torch.arange(len(ids) - keep, len(ids), device=self.device)
        logits = runner.prefill(row, prompt, need)  # [max(seed, 1), V]
        runner.kv.activate(row)
        root = int(choose(logits[-1:], seq.sampler, 0)[0])  # output position 0
        # Prompt seeding: the model's predictions inside this prompt are rows like any recycled ones.
        recycled = (recycle_rows(prompt[-seed:], logits, self.config.k, list(range(seed)), runner.last_topk)
                    if seed else None)
        text = TextStream(self.tokenizer)
        prefill_s = time.perf_counter() - t0
        session = source.open(tree, self.spec) if source else None
        if session is not None:
            seq.lookup = ContextLookup(ids, max_ngram=len(tree.template.lookup))
        try:
            seq.commit([root])
            yield StepChunk(tokens=[root], text=text.delta(seq.generated, cut=seq.stops.cut_text))
            while seq.finish_reason is None:
                if cancelled is not None and cancelled():
                    seq.finish_reason = "cancelled"
                    break
                if deadline is not None and time.monotonic() > deadline:
                    seq.finish_reason = "time_limit"
                    break
                if session is None:
                    new = self._ar_step(runner, root, seq)
                else:
                    new, recycled = self._tr_step(runner, session, recycled, root, tree, seq)
                new = seq.commit(new)
                seq.accepted_per_step.append(len(new))
                root = new[-1] if new else root
                if new:
                    yield StepChunk(tokens=new, text=text.delta(seq.generated, cut=seq.stops.cut_text))
        finally:
            if session is not None:
                session.close(recycled)
        decode_s = time.perf_counter() - t0 - prefill_s
        final_text = seq.stops.cut_text(self.tokenizer.decode(seq.generated, skip_special_tokens=True))
        info = session.info() if session is not None else None
        tree_name = self.tree_name(tree, seq.tuner) if session else "none"
        stats = GenerationStats.build(seq, prefill_s, decode_s, info, tree_name)
        yield GenerationResult(ids=seq.generated, text=final_text, finish_reason=seq.finish_reason, stats=stats)

    def _ar_step(self, runner: ModelRunner, root: int, seq: Sequence) -> list[int]:
        d = self.device
        one = RowInput(torch.tensor([root], device=d), torch.zeros(1, dtype=torch.long, device=d),
                       torch.zeros(1, 1, dtype=runner.dtype, device=d))
        logits = runner.step([one])[0]  # [1, V]
        top = runner.last_topk[0] if runner.last_topk is not None else None
        runner.keep([[0]])
        return [int(choose(logits, seq.sampler, len(seq.generated), top)[0])]

    def _tr_step(self, runner: ModelRunner, session, recycled, root: int, tree: CompiledTree, seq: Sequence):
        drafted = session.step(recycled, root)  # [n_draft] the matrix-drafted tree
        plan = seq.tuner.plan() if seq.tuner is not None else StepPlan(tree, None, explore=False)
        draft = draft_step(seq, drafted, plan)
        past = runner.kv.length(0)
        logits = runner.step([RowInput(draft.tokens, draft.tree.depth, draft.tree.mask)])[0]  # [n + chain, V]
        top = runner.last_topk[0] if runner.last_topk is not None else None
        acc, rows = accept_step(seq, draft, logits, self.config.k, past, top)
        runner.keep([acc.path])
        return acc.tokens, rows
