"""The decode loop, the only one: each step verifies the trees of every running request in one
forward (continuous batching); one request alone is the B=1 case.

Per step, schedule -> run -> postprocess: retire finished / cancelled / timed-out sequences (their
KV row is freed at once), admit waiting ones within the budgets and pick the prompt in progress to
prefill one chunk of (engine/scheduler.py: fewest chunks left first, so a long prompt delays the
running ones by one chunk a step and a short one is not queued behind it); then one batch forward
over all running sequences, each verifying what its proposer drafted at the size the tree budget
chose (engine/drafting/drafter.py); accept, recycle, commit and emit per sequence, each request's own part
ending it alone where it fails (engine/sequence.py:alone). TR specifics: engine/drafting/proposers/, engine/tr/
and engine/drafting/step.py; the runner (engine/model/runner.py) owns the model and the batch KV. Host syncs
per step: each sequence's accept decision, nothing per tree node. Driven by `run` in a thread of its
own (a worker) while callers `submit`, or by `stream`/`generate` in the caller's thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ..core.errors import InvalidArgument
from .model.runner import ModelRunner, quiet_torch_threads, uses_kernel_pool
from .prefix_cache import PrefixCache
from .request.request import PreparedRequest
from .request.stops import StopChecker
from .request.text import TextStream, reply_decoder
from .results import GenerationResult, GenerationStats, StepChunk
from .scheduler import EngineConfig, Scheduler, StepTimes
from .sequence import Sequence, alone
from .drafting.step import accept_step
from .tr.logprobs import record_logprobs, record_prompt_logprobs
from .target import TargetModel
from .tr.lookup import ContextLookup
from .tr.recycle import root_rows, top_probs
from .tr.seeding import PromptSeeding
from .tr.sampling import choose, new_sampler
from .drafting.drafter import Drafter
from .drafting.handover import end_session
from .drafting.budget.tree import TreeBudget
from .tuning.cost import CostFn, device_proxy
from .tuning.online import OnlineTuner
from .tuning.records import AcceptanceLog

__all__ = ["BatchEngine", "EngineConfig"]
log = logging.getLogger("trserve.engine")
Emit = Callable[[StepChunk | GenerationResult | Exception], None]


class BatchEngine:
    """Continuous batching over one target model (see the module docstring). `cost`: the forward
    cost model trees are sized by (engine/tuning/cost.py:engine_cost); None = the device's proxy."""

    def __init__(self, target: TargetModel, config: EngineConfig = EngineConfig(), cost: CostFn | None = None) -> None:
        self.target, self.config = target, config
        # whether its linear layers run on the kernels' pool (`stepping`): set when the model loaded, walked once
        self._kernel_pool = uses_kernel_pool(target.model)
        self.runner = ModelRunner(target.model, config.max_batch + 1, target.loaded.dtype,
                                  native=target.loaded.native, topk=target.config.k,
                                  batch_step=target.loaded.batch_step)
        self.scheduler = Scheduler(config, self.runner.kv)
        self.budget = TreeBudget(config, cost or device_proxy(self.runner.device.type), self.runner.native is not None)
        # softmax probabilities of recycled ids: in C beside the native forward (~20x torch's logsumexp), else torch
        native = self.runner.native
        self.top_probs = native.top_probs if native is not None and target.device.type == "cpu" else top_probs
        self.drafter = Drafter(self.budget, target.device, self.runner.dtype, packed=self.runner.native is not None)
        # KV of finished (or shared) prompts for the tenant's later ones: native forward only (width-invariant bits)
        mb = config.prefix_cache_mb
        self.prefix = PrefixCache(mb << 20, config.prefix_min_tokens) if mb and self.runner.native is not None else None
        self.steps = 0
        self.times = StepTimes()
        self._looping = False  # a thread is in `run`

    # views of the scheduler's state (the servicer and tests read them)
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    prefilling = property(lambda self: self.scheduler.prefilling)
    reserved = property(lambda self: self.scheduler.reserved)

    # ---- the caller's side (any thread) ---------------------------------------------------------
    def submit(self, prepared: PreparedRequest, emit: Emit, *, matrix=None, cancelled: Callable[[], bool] | None = None,
               deadline: float | None = None, tuner: OnlineTuner | None = None, tenant: str = "",
               acceptance: AcceptanceLog | None = None, text: bool = True) -> None:
        """Queue a request; `emit` gets its StepChunks then its GenerationResult (on the stepping
        thread), or the exception of a failed step. `matrix`: an AdjacencyMatrix or DraftSource (None:
        a fresh matrix); `tuner`: an online tree tuner for a request naming no tree (default: the
        model's own when its tree is "adaptive"); `acceptance`: collects one record per TR step (it must
        belong to the tree used) for the tree optimiser; `text` False: chunks carry no text (a caller
        that reads only the result's saves a detokenization per step).
        Opens the request's draft session here, in the caller's thread (it may read a store), so the
        loop never waits on one. Raises ResourceExhausted when the request can never fit or the
        waiting queue is full."""
        d, req = self.target, prepared.request
        tuner = (tuner or d.autotuner) if req.uses_default_tree else None
        tree = tuner.universe if tuner is not None else prepared.tree
        if acceptance is not None and tree is not None and acceptance.template != tree.template:
            raise InvalidArgument(f"acceptance log is for tree {acceptance.template.name!r}, "
                                  f"but this request uses {tree.template.name!r}")
        seq = Sequence(prepared, StopChecker(d.tokenizer, set(prepared.stop_ids), req.stop_strings),
                       new_sampler(req.sampling, req.max_new_tokens, d.device), acceptance, tuner, d.device,
                       emit=emit, tree=tree, cancelled=cancelled, deadline=deadline,
                       rates_key=(tenant, tree.template if tree else None), deltas=text)
        self.scheduler.check_fits(seq)
        if req.mode == "tr":
            seq.drafting.session = d.draft_source(matrix).open(tree, d.spec)
            seq.drafting.lookup = ContextLookup(list(prepared.ids), max_ngram=len(tree.template.lookup))
        self.scheduler.enqueue(seq)

    def stream(self, prepared: PreparedRequest, *, cancelled: Callable[[], bool] | None = None,
               **submit) -> Iterator[StepChunk | GenerationResult]:
        """Submit one request and yield its StepChunks, then its GenerationResult. While no thread runs
        the loop, the caller's thread steps it (every queued request advances alongside). Closing the
        iterator early cancels the request. Other keywords as `submit`."""
        items: queue.SimpleQueue = queue.SimpleQueue()
        closed = threading.Event()
        self.submit(prepared, items.put, cancelled=lambda: closed.is_set() or bool(cancelled and cancelled()), **submit)
        done = False
        try:
            while not done:
                item = self._next(items)
                done = isinstance(item, (GenerationResult, Exception))
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            if not done:
                closed.set()
                while not isinstance(item := self._next(items), (GenerationResult, Exception)):
                    pass

    def generate(self, prepared: PreparedRequest, **kwargs) -> GenerationResult:
        """Decode one request to the end (keywords as `stream`)."""
        result = None
        for item in self.stream(prepared, **kwargs):
            result = item
        assert isinstance(result, GenerationResult)
        return result

    def _next(self, items: queue.SimpleQueue):
        """The next item for a caller: from the loop thread's output, or stepping here until one comes."""
        while True:
            if self._looping:
                return items.get()
            try:
                return items.get_nowait()
            except queue.Empty:
                with self.stepping(), self.target.model_lock:
                    if not self._looping and items.empty():
                        self._guarded_step()

    def stop(self) -> None:
        self.scheduler.stop()

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """What a thread calling `step` must hold around its steps (`run` does): inference mode, and
        torch's intra-op threads quiet while the compressed kernels' pool runs (without it, torch's
        OpenMP workers spin on the cores the kernels need: 4 rows' steps took 19 ms instead of ~9)."""
        with torch.inference_mode(), quiet_torch_threads(self._kernel_pool):
            yield

    def run(self) -> None:
        """The engine loop (one thread owns the model): step while there is work, else wait."""
        self._looping = True
        try:
            with self.stepping():
                while self.scheduler.wait_for_work():
                    with self.target.model_lock:
                        self._guarded_step()
        finally:
            self._looping = False
        for seq in self.scheduler.all():
            seq.finish_reason = seq.finish_reason or "cancelled"
            self._finish(seq)

    def _guarded_step(self) -> None:
        """One step: what a request's own part raises ends it alone (engine/sequence.py:alone); a failure
        of the step as a whole (the batch forward) fails every request in it."""
        try:
            self.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not stop serving
            log.exception("engine step failed; failing the %d requests in it", len(self.scheduler.all()))
            self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        """After a failed step: every request gets `exc` (its caller maps it), and the engine starts empty."""
        if self.prefix is not None:  # what a failed step's rows held is not trusted again
            self.prefix.clear()
        for seq in self.scheduler.clear():
            end_session(seq, whole=False)
            seq.caller.emit(exc)

    # ---- one step --------------------------------------------------------------------------------
    def longest_step_s(self, prompt_tokens: int | None = None) -> float:
        """How long a step may take now (engine/scheduler.py:Scheduler.longest_step_s)."""
        return self.scheduler.longest_step_s(self.times, prompt_tokens)

    def step(self) -> None:
        t0 = time.perf_counter()
        chunk = self._step()
        if chunk == self.config.prefill_chunk:
            self.times.chunk(time.perf_counter() - t0)
        elif chunk == 0 and self.running:
            self.times.step(time.perf_counter() - t0)

    def _step(self) -> int:
        """One step, schedule -> run -> postprocess; returns the prompt tokens it prefilled."""
        self.steps += 1
        prefilling, chunk = self._schedule(), 0
        if prefilling is not None:  # run: a chunk of one prompt (failed before it joined, it leaves next step)
            with alone(prefilling):
                chunk = self._prefill_chunk(prefilling)
        self._retire_finished()  # a first token (the prefill's) that met a stop: done before any decoding step
        if self.scheduler.running:
            self._postprocess(*self._run())  # one forward for every running request; accept, commit, emit
        self._retire_finished()
        return chunk

    def _schedule(self) -> Sequence | None:
        """Retire the finished, cancelled and timed-out; admit within the budgets. Returns the request
        to prefill a chunk of, if any."""
        sched = self.scheduler
        self._retire([x for x in sched.running if x.stopping()])
        # a prompt whose next chunk would end past its deadline stops now: the caller's margin covers
        # a step the engine is in when the deadline passes, not a long prompt's chunk started just before
        # (a chunk deep in a 2000-token prompt took over 1.5x the mean chunk on a loaded host)
        for gone in sched.drop_prefills(sched.next_chunk_s):
            self._finish(gone)
        for seq in sched.admit():
            self._finish(seq)
        return sched.pick_prefill(self.config.prefill_chunk)

    def _retire_finished(self) -> None:
        self._retire([x for x in self.scheduler.running if x.finish_reason is not None])

    def _prefill_chunk(self, seq: Sequence) -> int:
        """The next chunk of `seq`'s prompt (the first one after any cached prefix); returns its length."""
        ids, d, place, drafting = seq.prepared.ids, self.target, seq.place, seq.drafting
        p, echo = len(ids), seq.prompt_logprobs is not None  # echo: every position's logits
        if place.done == 0:
            if self.prefix is not None and not echo:  # a cached prefix of its tenant's, loaded into its row
                place.done = place.cached = self.prefix.reuse(seq.tenant, ids, self.runner.kv, place.row)
            if drafting.session is not None:  # prompt seeding (tr/seeding.py), scaled by the share of tree steps
                share = self.budget.tree_share if self.config.batch_aware else 1.0
                drafting.seeding = PromptSeeding.plan(list(ids), place.done, round(d.config.seed_from_prompt * share),
                                                      drafting.session.known_rows)
        c = min(self.config.prefill_chunk, p - place.done)
        chunk = torch.tensor(ids[place.done : place.done + c], device=d.device)
        seeded = drafting.seeding.in_chunk(place.done, c) if drafting.seeding is not None else []  # seed the matrix
        last = [c - 1] if place.done + c == p and (not seeded or seeded[-1] != c - 1) else []
        need = list(range(c)) if echo else seeded + last  # + the prompt's last (the first token's)
        t0 = time.perf_counter()
        logits = self.runner.prefill(place.row, chunk, torch.tensor(need, dtype=torch.long, device=d.device))  # [m, V]
        seconds = time.perf_counter() - t0
        if seeded:
            at = seeded if echo else list(range(len(seeded)))  # their rows of `logits`
            known = self.runner.last_topk[at] if self.runner.last_topk is not None else None
            drafting.seeding.take(chunk[seeded], logits[at], known, d.config.k, self.top_probs)
        if echo:  # row q predicts prompt token done + q + 1
            record_prompt_logprobs(seq, logits, ids[place.done + 1: place.done + c + 1])
        place.prefilled(c, seconds)
        if place.done == p:
            self._start(seq, logits[-1:])
        return c

    def _start(self, seq: Sequence, last: torch.Tensor) -> None:
        """The prompt is in: first token, draft session, and the sequence joins the batch."""
        self.scheduler.join(seq)
        if self.prefix is not None:  # its tenant's waiting prompts that share its prefix (n > 1) prefill it once
            self.prefix.share(seq.tenant, seq.prepared.ids, self.scheduler.waiting_prompts(seq.tenant),
                              self.runner.kv, seq.place.row, seq.place.cached)
        seq.root = int(choose(last, seq.sampler, 0, rules=seq.rules, contexts=[[]])[0])
        if seq.drafting.seeding is not None:
            seq.drafting.recycled = seq.drafting.seeding.take_rows()
        kept = seq.prepared.request.kept_special
        seq.caller.text = TextStream(self.target.tokenizer, kept) if seq.caller.deltas else None
        seq.place.prefill_s = time.perf_counter() - seq.caller.t0
        self._emit(seq, record_logprobs(seq, last, seq.commit([seq.root])))

    def _run(self) -> tuple:
        """Every running request's draft (engine/drafting/drafter.py), then one forward over all of them."""
        running = self.scheduler.running
        drafts, inputs, spent = self.drafter.drafts(running, self.steps, self.scheduler.mean_kv())
        t0 = time.perf_counter()
        logits = self.runner.step(inputs, probs=any(seq.drafting.session is not None for seq in running))  # per row [w_b, V]
        self.budget.costs.measured(self.drafter.width, self.scheduler.mean_kv(), time.perf_counter() - t0)
        tops = self.runner.last_topk or [None] * len(logits)  # per row [w_b, k] where the forward computed them
        probs = self.runner.last_probs or [None] * len(logits)  # per row [w_b, k]: their confidences, likewise
        return drafts, logits, tops, probs, spent

    def _postprocess(self, drafts: list, logits: list, tops: list, probs: list, spent_drafting: list) -> None:
        """Per running request: accept (a tree's longest matching path, or the plain choice), recycle,
        commit, emit; then the KV keeps only each row's accepted path."""
        running, budget = self.scheduler.running, self.budget
        keep, k = [], self.target.config.k
        at = [i for i, (seq, draft) in enumerate(zip(running, drafts)) if draft is None and seq.drafting.session is not None]
        plain_rows = iter(root_rows([logits[i] for i in at], [tops[i] for i in at], [probs[i] for i in at], k,
                                    self.top_probs))  # recycled like any verified node's
        for seq, draft, lg, top, q, spent in zip(running, drafts, logits, tops, probs, spent_drafting):
            plain = next(plain_rows) if draft is None and seq.drafting.session is not None else None
            keep.append([0])  # a request that fails here keeps its root alone until it retires
            if seq.error is not None:  # failed while drafting
                continue
            with alone(seq):
                keep[-1] = self._accept(seq, draft, lg, top, q, plain, spent)
        budget.trees_verified(sum(seq.drafting.session is not None for seq in running), sum(d is not None for d in drafts))
        self.runner.keep(keep)

    def _accept(self, seq: Sequence, draft, lg: torch.Tensor, top, q, plain, spent: float) -> list[int]:
        """One request's accept, recycle, commit and emit; returns the path of its row the KV keeps."""
        t0, k = time.perf_counter(), self.target.config.k
        if draft is None:  # plain decoding this step
            chosen = choose(lg, seq.sampler, len(seq.generated), top, seq.rules, [seq.generated])
            new, path = [int(chosen[0])], [0]
            if plain is not None:  # the root's top-k is recycled like any verified node's
                seq.drafting.plain.append((seq.root, *plain))
        else:
            acc, seq.drafting.recycled = accept_step(seq, draft, lg, k, top, self.top_probs if q is None else q)
            new, path = acc.tokens, acc.path
            self.drafter.learn(seq, draft, acc, self.runner.kv.length(seq.place.row))
        new = record_logprobs(seq, lg, seq.commit(new), path)  # the logits row path[i] chose new[i]
        seq.accepted_per_step.append(len(new))
        seq.root = new[-1] if new else seq.root
        self._emit(seq, new)
        self.budget.costs.host(draft is not None, spent + time.perf_counter() - t0)
        return path

    def cost(self, width: int, kv: int) -> float:
        """Seconds of a forward of `width` tokens at KV length `kv`, as the tree budget prices it."""
        return self.budget.cost(width, kv)

    # ---- output and retirement ------------------------------------------------------------------
    def _emit(self, seq: Sequence, new: list[int]) -> None:
        if new:
            logprobs = tuple(seq.logprobs[-len(new):]) if seq.logprobs is not None else None
            text = seq.caller.text.delta(seq.generated, cut=seq.stops.cut_text) if seq.caller.text is not None else ""
            seq.caller.emit(StepChunk(tokens=new, text=text, logprobs=logprobs))

    def _retire(self, done: list[Sequence]) -> None:
        if self.prefix is not None:  # their rows (prompt and committed tokens) for their tenants' next prompts
            for seq in done:
                if seq.error is None:  # a failed request's row may hold more than its committed tokens
                    self.prefix.keep(seq.tenant, list(seq.prepared.ids) + seq.generated, self.runner.kv, seq.place.row)
        self.scheduler.retire(done)
        for seq in done:
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        """`seq` leaves the engine and its caller gets its result, or the error that building the result
        raised: a caller always hears back (a finish that raised once left its caller waiting forever,
        its request already gone from every list the failed step's clean-up reads)."""
        self.scheduler.release(seq)
        if seq.error is not None:  # it ended alone: its rows are not recycled, its caller gets the error
            end_session(seq, whole=False)
            seq.caller.emit(seq.error)
            return
        try:
            result = self._result(seq)
        except Exception as exc:  # noqa: BLE001 - the caller maps it to a status
            log.exception("finishing a request failed; its caller gets the error")
            result = exc
        seq.caller.emit(result)

    def _result(self, seq: Sequence) -> GenerationResult:
        d = self.target
        info = None
        if seq.drafting.session is not None:
            end_session(seq, whole=True)
            info = seq.drafting.session.info()
        decode_s = time.perf_counter() - seq.caller.t0 - seq.place.prefill_s
        text = seq.stops.cut_text(reply_decoder(d.tokenizer, seq.prepared.request.kept_special)(seq.generated))
        tree = d.tree_name(seq.drafting.tree, seq.drafting.tuner) if seq.drafting.session is not None else "none"
        stats = GenerationStats.build(seq, seq.place.prefill_s, decode_s, info, tree, seq.place.cached)
        return GenerationResult(ids=seq.generated, text=text, finish_reason=seq.finish_reason or "cancelled",
                                stats=stats, logprobs=tuple(seq.logprobs) if seq.logprobs is not None else None,
                                prompt_logprobs=tuple(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None)
