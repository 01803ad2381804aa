"""The target model facade beneath the engine: load, validate requests against the model
(`prepare`), compile trees, fresh matrices, draft sources and online tuners. No decoding here:
the one decode loop is engine/engine.py:BatchEngine."""

from __future__ import annotations

import threading
from pathlib import Path

from ..core.errors import InvalidArgument
from ..core.model_spec import ModelSpec
from .config import DecoderConfig
from .model.loader import LoadedModel, load_model
from .model.native import rope_positions
from .request.prompt import PromptBuilder, check_token_ids
from .request.tools import tool_template
from .request.request import GenerationRequest, PreparedRequest
from .tr.grammar import GrammarCompiler
from .tr.history import SuffixHistory
from .tr.matrix import AdjacencyMatrix
from .tr.source import DraftSource, LocalDraftSource
from .tr.tree import CompiledTree, TreeTemplate, get_compiled, load_template
from .tuning.online import OnlineTuner


class TargetModel:
    """The target model as the engine uses it: model + tokenizer, request validation (`prepare`),
    tree compilation, fresh matrices, draft sources and online tuners."""

    def __init__(self, config: DecoderConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.fingerprint = self.loaded.fingerprint
        self.device = self.loaded.device
        self.vocab_size = int(self.model.config.vocab_size)
        self.spec = ModelSpec(self.fingerprint, self.vocab_size, config.k)
        self.max_context = self._max_context(config.max_context)
        self.prompts = PromptBuilder(self.tokenizer, self.vocab_size, tool_template(
            getattr(self.tokenizer, "chat_template", None), custom=config.model.chat_template is not None))
        self.autotuner = self._new_autotuner() if config.tree == "adaptive" else None
        best_known = config.tree_for(self.device.type, self.loaded.kernels)
        self.default_tree = self.autotuner.universe if self.autotuner else self.compile(best_known)
        self.eos_ids = self._eos_ids()
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
        # One forward at a time on this model, whoever runs it (one engine's step; tests may build
        # several engines over one model): the attention function's per-forward mask cache is process state.
        self.model_lock = threading.Lock()

    # ---- setup helpers -------------------------------------------------------------------
    def _max_context(self, asked: int | None) -> int:
        """The configured context, else the model's max_position_embeddings; a longrope model's at most the
        positions its rotary table is static over (native.rope_positions: past them transformers' numbers
        depend on how a sequence is split into forwards, so no decoding there could be lossless)."""
        limit = rope_positions(self.model.config)
        if asked and limit and asked > limit:
            raise InvalidArgument(f"max_context {asked} exceeds this longrope model's {limit} positions "
                                  "(original_max_position_embeddings): past them transformers switches every "
                                  f"forward to the long factors, which no lossless decoding can follow; use <= {limit}")
        most = int(getattr(self.model.config, "max_position_embeddings", 2048))
        return asked or (min(most, limit) if limit else most)

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
        from .model.paths import default_cache_dir
        from .tuning.calibrate import load_or_measure

        cost = load_or_measure(self.loaded, Path(self.config.cache_dir) if self.config.cache_dir else default_cache_dir())
        return self._tuner(cost)

    def _tuner(self, cost) -> OnlineTuner:
        start = load_template(self.config.tree_for(self.device.type, self.loaded.kernels))
        universe = load_template(self.config.autotune.universe)
        self._check_ranks(universe)
        return OnlineTuner(self.config.autotune, universe, start, cost, self.device, self.loaded.dtype)

    def new_tuner(self) -> OnlineTuner:
        """A fresh online tuner like this model's own (tree "adaptive" only), e.g. one per tenant."""
        if self.autotuner is None:
            raise InvalidArgument('online tuning needs DecoderConfig(tree="adaptive")')
        return self._tuner(self.autotuner.cost)

    @staticmethod
    def tree_name(tree: CompiledTree, tuner: OnlineTuner | None) -> str:
        return f"adaptive:{tuner.current.size}" if tuner is not None else tree.template.name

    def new_matrix(self) -> AdjacencyMatrix:
        return AdjacencyMatrix(self.spec, self.device)

    def new_tenant(self, history: bool = True) -> LocalDraftSource:
        """One tenant's in-process drafting state, to pass as `matrix=` to every request of that tenant:
        a fresh matrix and (history=True) a history of its requests (engine/tr/history.py) that
        dynamic trees draft from. Never share one between tenants."""
        return LocalDraftSource(self.new_matrix(), SuffixHistory() if history else None)

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
        ids = self.prompts.build(request.prompt, request.messages, request.input_ids, request.chat, request.tools)
        tree = None
        if request.mode == "tr":
            tree = self._resolve_tree(request.tree) if request.tree is not None else self.default_tree
        self._check_budget(len(ids), request.max_new_tokens, tree)
        stop_ids = frozenset(check_token_ids(request.stop_token_ids, self.vocab_size, "stop token ids"))
        check_token_ids([i for i, _ in request.logit_bias], self.vocab_size, "logit_bias token ids")
        check_token_ids(request.kept_special, self.vocab_size, "kept special token ids")
        grammar = self.grammars.compile(request.structured) if request.structured is not None else None
        stops = stop_ids | (frozenset() if request.ignore_eos else self.eos_ids)
        if grammar is not None and request.min_tokens and stops:
            first = grammar.first()  # [V]
            first[[i for i in stops if i < first.shape[0]]] = False
            if not first.any():
                raise InvalidArgument(f"structured output {request.structured.kind!r} allows only a stop token "
                                      f"first, and min_tokens={request.min_tokens} forbids stop tokens before then: "
                                      "drop min_tokens or the stop ids the output would start with")
        return PreparedRequest(request, tuple(ids), tree, stops, grammar)

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

    def draft_source(self, matrix: AdjacencyMatrix | DraftSource | None) -> DraftSource:
        if matrix is None:
            return LocalDraftSource(self.new_matrix())
        if isinstance(matrix, AdjacencyMatrix):
            return LocalDraftSource(matrix)
        if hasattr(matrix, "open"):
            return matrix
        raise InvalidArgument(f"matrix must be an AdjacencyMatrix or a DraftSource, got {type(matrix).__name__}")
