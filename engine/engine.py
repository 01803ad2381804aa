"""The batching engine: one loop per worker verifies the trees of every running request in one
forward (continuous batching). The scheduler part decides (admission by KV budget and batch size,
one prefill chunk per step, each sequence's tree size from engine/tuning/budget.py); the runner
(engine/model/runner.py) owns the model and the batch KV; per sequence the TR step is the same as
the serial decoder's (engine/step.py), so outputs equal decoding alone (up to float ties).

Per step: retire finished / cancelled / timed-out sequences (their KV row is freed at once); admit
waiting ones within the budgets; run one prefill chunk (<= `prefill_chunk` tokens) of the sequence
being prefilled, so a long prompt delays the running ones by at most one chunk per step; then one
batch forward over all running sequences. Host syncs per step: the accept decision of each
sequence (its greedy tokens, `.tolist()`), nothing per tree node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from core.errors import ResourceExhausted
from engine.decoder import Decoder
from engine.model.runner import ModelRunner, RowInput, quiet_torch_threads, uses_kernel_pool
from engine.request.request import PreparedRequest
from engine.request.stops import StopChecker
from engine.request.text import TextStream
from engine.results import GenerationResult, GenerationStats, StepChunk
from engine.sequence import Sequence
from engine.step import accept_step, draft_step
from engine.tr.lookup import ContextLookup, Proposal
from engine.tr.recycle import RecycledRows, select_rows, top_ids
from engine.tr.sampling import choose, new_sampler
from engine.tr.source import DraftSession
from engine.tr.tree import CompiledTree, TreeTemplate
from engine.tuning.budget import NodeRates, choose_options, choose_packed
from engine.tuning.online import OnlineTuner, StepPlan

log = logging.getLogger("trserve.engine")
SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # subtree sizes (root included) a step may pick


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # sequences decoding at once (running + the one prefilling)
    max_batch_tokens: int = 32768  # KV tokens the admitted sequences may reserve (prompt + max_new + tree)
    max_waiting: int = 64  # admitted beyond the budgets: wait; beyond this: ResourceExhausted
    prefill_chunk: int = 128  # prompt tokens prefilled per step
    batch_aware: bool = True  # trees sized per step for the batch; False = every sequence its full tree
    explore_every: int = 4  # batch-aware: at most every N * B steps one sequence (in turn) verifies its whole tree
    # ... and at most this share of the step time goes to those explorations (their extra width under the
    # calibrated costs: steep width costs, e.g. AVX2 CPUs, explore less often)
    explore_budget: float = 0.04
    # batch-aware: a step with trees must promise this much more than plain decoding (a share of tok/s) under
    # the cost model, whose calibration is noisy (engine/tuning/budget.py)
    tree_margin: float = 0.05

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_batch_tokens < 64 or self.max_waiting < 0 or self.prefill_chunk < 1:
            raise ValueError("max_batch >= 1, max_batch_tokens >= 64, max_waiting >= 0, prefill_chunk >= 1")
        if self.explore_every < 1:
            raise ValueError(f"explore_every must be >= 1, got {self.explore_every}")
        if not 0 < self.explore_budget <= 1:
            raise ValueError(f"explore_budget must be in (0, 1], got {self.explore_budget}")
        if not 0 <= self.tree_margin < 1:
            raise ValueError(f"tree_margin must be in [0, 1), got {self.tree_margin}")


def proxy_cost(width: int, kv: int) -> float:
    """A forward's cost on a CPU when no calibration is at hand (the AVX-512 calibration's shape:
    1 token 16 ms, 4 tokens 20 ms, 16 tokens 42 ms, plus attention over the context)."""
    return 0.0145 + 0.0017 * width + 2e-6 * kv * width


def gpu_proxy_cost(width: int, kv: int) -> float:
    """The same on a GPU: a small model's graphed forward is bound by its launches and weight reads
    far beyond the widths a batch reaches (a guess of the shape, not a measurement: no GPU has been
    at hand; the loop's online correction scales it, and `trserve tune` measures the real one)."""
    return 0.004 + 2e-6 * width + 2e-9 * kv * width


@dataclass(eq=False)
class _Live:
    """One request in the engine."""

    seq: Sequence
    emit: Callable[[StepChunk | GenerationResult | Exception], None]
    tree: CompiledTree | None
    cancelled: Callable[[], bool] | None
    deadline: float | None
    rates_key: tuple
    t0: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    done: int = 0  # prompt tokens prefilled
    row: int = -1
    session: DraftSession | None = None  # None for plain decoding
    recycled: RecycledRows | None = None
    plain: list = field(default_factory=list)  # (root, its top-k [K]) of plain steps since the last draft
    root: int = 0
    text: TextStream | None = None
    seed: list = field(default_factory=list)  # (tokens [c], topk [c, K]) of prompt seeding, per chunk
    seed_n: int = 0  # prompt positions whose predictions seed its matrix (fixed when its prefill starts)

    @property
    def reserved(self) -> int:
        width = self.tree.template.max_width if self.tree is not None else 1
        return self.seq.prompt_len + self.seq.max_new_tokens + width


class BatchEngine:
    """Continuous batching over one Decoder's model (see the module docstring)."""

    def __init__(self, decoder: Decoder, config: EngineConfig = EngineConfig(),
                 cost: Callable[[int, int], float] | None = None) -> None:
        self.decoder, self.config = decoder, config
        self.runner = ModelRunner(decoder.model, config.max_batch + 1, decoder.loaded.dtype,
                                  native=decoder.loaded.native, topk=decoder.config.k,
                                  batch_step=decoder.loaded.batch_step)
        self._cost_fn = cost or (gpu_proxy_cost if self.runner.device.type == "cuda" else proxy_cost)
        self._costs: dict[tuple[int, int], float] = {}  # (width, kv // 32): the cost model, looked up once
        self.waiting: deque[_Live] = deque()
        self.prefilling: _Live | None = None
        self.running: list[_Live] = []  # running[i].row == i
        self.reserved = 0
        self._rates: dict[tuple, NodeRates] = {}
        self._subtrees: dict[tuple[TreeTemplate, int], CompiledTree] = {}
        self._lock = threading.Condition()
        self._stop = False
        self.steps = 0
        self._explorer: _Live | None = None  # the sequence verifying its whole tree this step
        self._explore_credit = 0.0  # seconds of step time exploration may still spend
        self._explored = 0  # explorations so far (whose turn is next)
        self._last_width = 1  # the previous step's total (packed) or padded width
        # per-sequence host seconds of a step outside the forward (drafting, acceptance, recycling,
        # streaming), measured: {True: a tree step, False: a plain one}; the difference is what a tree
        # costs beyond its forward width (engine/tuning/budget.py, `extra`)
        self._host_s = {True: 5e-4, False: 1e-4}
        # measured forward seconds / the cost model's: the host's speed against the calibration's (one
        # EMA over all steps), and per step width that width's own ratio relative to it (EMA; 1.0 until
        # measured). The calibration's cells are each a fastest-of-a-few on a noisy host, and a few
        # percent of error between width 1 and 2 decides whether a small tree pays (measured here:
        # width 2 priced 3% above width 1, took 18% more in the decode loop); and a width never measured
        # must be priced at the host's current speed, not the calibration's, or in a slow spell every
        # wider step looks cheap next to the (measured) usual one
        self._speed = 1.0
        self._cost_ratio: dict[int, float] = {}
        # share of the TR sequences' steps that verified a tree (EMA over steps): what a TR request's own
        # extra work buys is drafts, worth something only while the batch verifies trees, so prompt
        # seeding (LM-head rows over the prompt's last positions) and exploration scale with it; under
        # a load where the budget verifies only plain steps a TR request then costs what an AR one does
        self._tree_share = 1.0

    # ---- the caller's side (any thread) ---------------------------------------------------------
    def submit(self, prepared: PreparedRequest, emit: Callable[[StepChunk | GenerationResult | Exception], None], *,
               matrix=None, cancelled: Callable[[], bool] | None = None, deadline: float | None = None,
               tuner: OnlineTuner | None = None, tenant: str = "") -> None:
        """Queue a request; `emit` gets its StepChunks then its GenerationResult (on the engine thread),
        or the exception of a failed step.
        Opens the request's draft session here, in the caller's thread (it may read a store), so the
        engine loop never waits on one. Raises ResourceExhausted when the request can never fit or
        the waiting queue is full."""
        d, req = self.decoder, prepared.request
        tuner = (tuner or d.autotuner) if req.uses_default_tree else None
        tree = tuner.universe if tuner is not None else prepared.tree
        seq = Sequence(prepared, StopChecker(d.tokenizer, set(prepared.stop_ids), req.stop_strings),
                       new_sampler(req.sampling, req.max_new_tokens, d.device), None, tuner)
        live = _Live(seq, emit, tree, cancelled, deadline, (tenant, tree.template if tree else None))
        if live.reserved > self.config.max_batch_tokens:
            raise ResourceExhausted(f"the request needs {live.reserved} KV tokens; this engine holds at most "
                                    f"{self.config.max_batch_tokens}: shorten the prompt or max_new_tokens")
        with self._lock:
            if len(self.waiting) >= self.config.max_waiting:
                raise ResourceExhausted(f"engine full: {len(self.running)} decoding, {len(self.waiting)} waiting "
                                        f"(max_waiting={self.config.max_waiting}); retry later or use another worker")
        if req.mode == "tr":
            live.session = d.draft_source(matrix).open(tree, d.spec)
            seq.lookup = ContextLookup(list(prepared.ids), max_ngram=len(tree.template.lookup))
        with self._lock:
            self.waiting.append(live)
            self._lock.notify()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """What a thread calling `step` must hold around its steps (`run` does): inference mode, and
        torch's intra-op threads quiet while the compressed kernels' pool runs (without it, torch's
        OpenMP workers spin on the cores the kernels need: 4 rows' steps took 19 ms instead of ~9)."""
        with torch.inference_mode(), quiet_torch_threads(uses_kernel_pool(self.decoder.model)):
            yield

    def run(self) -> None:
        """The engine loop (one thread owns the model): step while there is work, else wait."""
        with self.stepping():
            while True:
                with self._lock:
                    while not self._stop and not (self.waiting or self.running or self.prefilling):
                        self._lock.wait()
                    if self._stop:
                        break
                try:
                    with self.decoder.model_lock:
                        self.step()
                except Exception as exc:  # noqa: BLE001 - one bad step must not stop serving
                    log.exception("engine step failed; failing the %d requests in it", len(self._all()))
                    self._fail_all(exc)
        for live in self._all():
            live.seq.finish_reason = live.seq.finish_reason or "cancelled"
            self._finish(live)

    def _all(self) -> list[_Live]:
        with self._lock:
            return [*self.running, *([self.prefilling] if self.prefilling else []), *self.waiting]

    def _fail_all(self, exc: Exception) -> None:
        """After a failed step: every request in the engine gets `exc` (its caller maps it to a status)
        instead of a result, and the engine starts again empty."""
        lives = self._all()
        with self._lock:
            self.running, self.prefilling, self.waiting = [], None, deque()
        self.runner.kv.reset()
        self.reserved = 0
        for live in lives:
            if live.session is not None:
                try:
                    live.session.close(None)
                except Exception:  # noqa: BLE001
                    log.exception("closing a draft session after a failed step")
            live.emit(exc)

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> None:
        self.steps += 1
        self._retire([x for x in self.running if self._stopping(x)])
        if self.prefilling is not None and self._stopping(self.prefilling):
            live, self.prefilling = self.prefilling, None
            self._finish(live)
        self._admit()
        if self.prefilling is not None:
            self._prefill_chunk(self.prefilling)
        # a sequence whose first token (the prefill's) met a stop is done before any decoding step
        self._retire([x for x in self.running if x.seq.finish_reason is not None])
        if self.running:
            self._decode()
        self._retire([x for x in self.running if x.seq.finish_reason is not None])

    def _stopping(self, live: _Live) -> bool:
        if live.seq.finish_reason is not None:
            return True
        if live.cancelled is not None and live.cancelled():
            live.seq.finish_reason = "cancelled"
        elif live.deadline is not None and time.monotonic() > live.deadline:
            live.seq.finish_reason = "time_limit"
        return live.seq.finish_reason is not None

    def _admit(self) -> None:
        with self._lock:
            while self.waiting and self._stopping(self.waiting[0]):
                self._finish(self.waiting.popleft())
            if self.prefilling is not None or not self.waiting:
                return
            head = self.waiting[0]
            if len(self.running) + 1 > self.config.max_batch or self.reserved + head.reserved > self.config.max_batch_tokens:
                return
            self.waiting.popleft()
        self.reserved += head.reserved
        head.row = self.runner.kv.open_row()
        self.prefilling = head

    def _prefill_chunk(self, live: _Live) -> None:
        ids, d = live.seq.prepared.ids, self.decoder
        p = len(ids)
        c = min(self.config.prefill_chunk, p - live.done)
        chunk = torch.tensor(ids[live.done : live.done + c], device=d.device)
        if live.done == 0 and live.session is not None:
            live.seed_n = min(p, round(d.config.seed_from_prompt * self._tree_share))
        seed = live.seed_n
        first_seed = max(live.done, p - seed)  # prompt positions whose predictions seed the matrix
        need = list(range(first_seed - live.done, c))
        if live.done + c == p and (not need or need[-1] != c - 1):
            need.append(c - 1)
        logits = self.runner.prefill(live.row, chunk, torch.tensor(need, dtype=torch.long, device=d.device))  # [m, V]
        seeded = [i for i in need if live.done + i >= p - seed] if seed else []
        if seeded:
            known = self.runner.last_topk[: len(seeded)] if self.runner.last_topk is not None else None
            live.seed.append((chunk[seeded], top_ids(logits[: len(seeded)], d.config.k, known)))
        live.done += c
        if live.done == p:
            self._start(live, logits[-1:])

    def _start(self, live: _Live, last: torch.Tensor) -> None:
        """The prompt is in: first token, draft session, and the sequence joins the batch."""
        seq, d = live.seq, self.decoder
        self.runner.kv.activate(live.row)
        self.prefilling = None
        self.running.append(live)
        live.root = int(choose(last, seq.sampler, 0)[0])
        if live.seed:
            live.recycled = _latest_rows(torch.cat([t for t, _ in live.seed]), torch.cat([k for _, k in live.seed]))
            live.seed = []
        live.text = TextStream(d.tokenizer)
        live.prefill_s = time.perf_counter() - live.t0
        self._emit(live, seq.commit([live.root]))

    def _decode(self) -> None:
        drafts, inputs, spent_drafting = self._drafts()
        t0 = time.perf_counter()
        logits = self.runner.step(inputs)  # per row [w_b, V]
        self._measured(self._last_width, self._mean_kv(), time.perf_counter() - t0)
        tops = self.runner.last_topk or [None] * len(logits)  # per row [w_b, k] where the forward computed them
        keep, k = [], self.decoder.config.k
        for live, draft, lg, top, spent in zip(self.running, drafts, logits, tops, spent_drafting):
            t0 = time.perf_counter()
            seq = live.seq
            if draft is None:  # plain decoding this step
                new, path = [int(choose(lg, seq.sampler, len(seq.generated), top)[0])], [0]
                if live.session is not None:  # the root's top-k is recycled like any verified node's
                    live.plain.append((live.root, top_ids(lg[:1], k, top[:1] if top is not None else None)[0]))
            else:
                acc, live.recycled = accept_step(seq, draft, lg, k, self.runner.kv.length(live.row), top)
                new, path = acc.tokens, acc.path
                self._learn(live, draft, acc)
            keep.append(path)
            new = seq.commit(new)
            seq.accepted_per_step.append(len(new))
            live.root = new[-1] if new else live.root
            self._emit(live, new)
            tree = draft is not None
            self._host_s[tree] += 0.02 * (spent + time.perf_counter() - t0 - self._host_s[tree])
        tr = sum(live.session is not None for live in self.running)
        if tr:
            trees = sum(d is not None for d in drafts)
            self._tree_share += 0.05 * (trees / tr - self._tree_share)
        self.runner.keep(keep)

    def _drafts(self) -> tuple[list, list[RowInput], list[float]]:
        """Each running sequence's draft (None = plain decoding this step), its row input and the
        seconds its drafting took, with tree sizes chosen for the whole batch (engine/tuning/budget.py)."""
        self._explorer = self._next_explorer()
        staged, options = [], []
        for live in self.running:
            if live.session is None:  # an AR-mode request
                staged.append(None)
                options.append([(1, 1.0, 1, 0)])
                continue
            plan = live.seq.tuner.plan() if live.seq.tuner is not None else StepPlan(live.tree, None, explore=False)
            proposal = live.seq.lookup.propose(plan.tree.template.lookup)
            staged.append((plan, proposal))
            options.append(self._options(live, plan, proposal))
        chosen = self._choose(options)
        drafts, inputs = [], []
        dev = self.decoder.device
        spent = []
        for live, stage, opts, j in zip(self.running, staged, options, chosen):
            t0 = time.perf_counter()
            _, _, size, chain = opts[j]  # chain: lookup tokens to verify (0: none)
            if stage is None or size == 1:
                drafts.append(None)
                inputs.append(RowInput(torch.tensor([live.root], device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                                       torch.zeros(1, 1, dtype=self.runner.dtype, device=dev)))
                spent.append(time.perf_counter() - t0)
                continue
            plan, proposal = stage
            # Only a sequence that verifies a tree drafts (and hands over its pending rows) this step: a
            # plain step costs a TR request no more than an AR one.
            drafted = live.session.step(_pending(live), live.root)  # [n_draft]
            live.recycled = None
            if size is not None and size < plan.tree.n:
                sub = self._subtree(plan.tree, size)
                plan = StepPlan(sub, torch.arange(sub.n, device=dev), explore=False)
            if proposal is not None and chain and chain < len(proposal.tokens):
                proposal = Proposal(proposal.tokens[:chain], proposal.ngram)
            draft = draft_step(live.seq, drafted, plan, proposal, lookup=bool(chain))
            drafts.append(draft)
            inputs.append(RowInput(draft.tokens, draft.tree.depth, draft.tree.mask))
            spent.append(time.perf_counter() - t0)
        widths = [r.tokens.shape[0] for r in inputs]
        self._last_width = sum(widths) if self.runner.native is not None else len(widths) * max(widths)
        return drafts, inputs, spent

    def _mean_kv(self) -> int:
        """The running sequences' mean KV length: where the cost model is read this step."""
        b = len(self.running)
        return sum(self.runner.kv.rows.lens[:b]) // max(b, 1)

    def cost(self, width: int, kv: int) -> float:
        """Seconds of a forward of `width` tokens at KV length `kv` (to 32 tokens): the cost model,
        corrected by what forwards of that width measured in this loop."""
        return self._model_cost(width, kv) * self._speed * self._cost_ratio.get(width, 1.0)

    def _model_cost(self, width: int, kv: int) -> float:
        key = (width, kv // 32)
        c = self._costs.get(key)
        if c is None:
            if len(self._costs) > 65536:
                self._costs.clear()
            c = self._costs[key] = self._cost_fn(width, key[1] * 32)
        return c

    def _measured(self, width: int, kv: int, seconds: float) -> None:
        """A forward of `width` tokens at KV length `kv` took `seconds`: the host's speed and the width's
        own correction move towards it (EMAs, 0.1 per step; one sample's ratio clamped to [0.5, 2]: one
        preempted step must not price a width out)."""
        model = self._model_cost(width, kv)
        if model <= 0:
            return
        r = min(max(seconds / model, 0.5), 2.0)
        self._speed += 0.1 * (r - self._speed)
        prev = self._cost_ratio.get(width, 1.0)
        self._cost_ratio[width] = prev + 0.1 * (r / self._speed - prev)

    def _next_explorer(self) -> _Live | None:
        """The sequence (in turn) that may verify its whole base tree (and lookup chain) this step, or
        None. Exploring keeps every node's rate measured; it is offered at most every explore_every * B
        steps, and `_options` takes it only while the credit (explore_budget x the time of the steps so
        far, x the share of steps that verify trees, at least a quarter) pays its extra width, priced
        there with the chain it would verify."""
        b = len(self.running)
        last = self.cost(self._last_width, self._mean_kv())
        budget = self.config.explore_budget * max(self._tree_share, 0.25)  # a quarter of it while no tree pays
        self._explore_credit = min(self._explore_credit + budget * last, 1.0)
        if self.steps % (self.config.explore_every * b):
            return None
        live = self.running[self._explored % b]
        self._explored += 1
        if live.session is None or live.seq.tuner is not None:
            return None
        return live

    def _explore_price(self, width: int) -> float:
        """Seconds an exploration of `width` tokens adds to this step (against the step's usual width)."""
        b, kv = len(self.running), self._mean_kv()
        last = self.cost(self._last_width, kv)
        if self.runner.native is not None:  # packed: only the explorer's own extra nodes
            wider = self._last_width + width - 1
        else:  # padded: every row to the explorer's width
            wider = b * max(self._last_width // b, width)
        return max(self.cost(wider, kv) - last, 0.0)

    def _options(self, live: _Live, plan: StepPlan, proposal) -> list[tuple[int, float, int | None, int]]:
        """(width, expected tokens, base nodes or None = the plan as it is, lookup chain tokens) per
        option; the first is plain decoding."""
        chain = len(proposal.tokens) if proposal is not None else 0
        if live.seq.tuner is not None or not self.config.batch_aware:  # the tuner's (or the full) plan, always
            return [(plan.tree.n + chain, 1.0, None, chain)]
        if live is self._explorer:  # its whole base tree (and lookup chain) now and then, so every node's
            # rate and the chains' worth stay measured: a worth measured low on a cold matrix would
            # otherwise never be looked at again; priced with its chain (up to 16 tokens: most of its cost)
            price = self._explore_price(plan.tree.n + chain)
            if price <= self._explore_credit:
                self._explore_credit -= price
                return [(plan.tree.n + chain, 1.0, None, chain)]
            self._explorer = None
        rates = self._node_rates(live)
        return rates.options([s for s in SIZES if s < plan.tree.n] + [plan.tree.n], chain)

    def _node_rates(self, live: _Live) -> NodeRates:
        """The acceptance records of `live`'s tenant and base tree (created on first use)."""
        rates = self._rates.get(live.rates_key)
        if rates is None:
            rates = self._rates[live.rates_key] = NodeRates(live.tree.n)
        return rates

    def _choose(self, options: list[list[tuple[int, float, int | None, int]]]) -> list[int]:
        kv = self._mean_kv()
        opts = [[(w, t) for w, t, _, _ in o] for o in options]
        extra = max(self._host_s[True] - self._host_s[False], 0.0)  # a tree's host work beyond a plain step's
        if self.runner.native is not None:  # rows packed without pads: a step costs its summed width
            return choose_packed(opts, lambda n: self.cost(n, kv), extra, self.config.tree_margin)
        return choose_options(opts, lambda w: self.cost(w, kv), extra, self.config.tree_margin)

    def _subtree(self, tree: CompiledTree, size: int) -> CompiledTree:
        key = (tree.template, size)
        if key not in self._subtrees:
            t = tree.template
            sub = TreeTemplate.from_paths(f"{t.name}/{size}", t.paths[: size - 1], t.description, t.lookup)
            self._subtrees[key] = self.decoder.compile(sub)
        return self._subtrees[key]

    def _learn(self, live: _Live, draft, acc) -> None:
        if live.seq.tuner is not None:
            return
        rates = self._node_rates(live)
        n_base = draft.plan.tree.n
        base_path = [i for i in acc.path if i < n_base]
        chain = draft.tokens.shape[0] - n_base
        rates.record(n_base, base_path, chain, sum(i >= n_base for i in acc.path))  # chain nodes accepted

    # ---- output and retirement ------------------------------------------------------------------
    def _emit(self, live: _Live, new: list[int]) -> None:
        if new:
            seq = live.seq
            live.emit(StepChunk(tokens=new, text=live.text.delta(seq.generated, cut=seq.stops.cut_text)))

    def _retire(self, done: list[_Live]) -> None:
        for live in done:
            row = self.running.index(live)
            moved = self.runner.kv.close_row(row)
            if moved is not None:
                self.running[row] = self.running[moved]
                self.running[row].row = row
            self.running.pop()
            self._finish(live)
        if done and self.prefilling is not None and self.prefilling.row != self.runner.kv.active:
            self.runner.kv.move_row(self.prefilling.row, self.runner.kv.active)
            self.prefilling.row = self.runner.kv.active

    def _finish(self, live: _Live) -> None:
        seq, d = live.seq, self.decoder
        if live.reserved and live.row >= 0:
            self.reserved -= live.reserved
            live.row = -1
        info = None
        if live.session is not None:
            try:
                live.session.close(_pending(live))
            finally:
                info = live.session.info()
        decode_s = time.perf_counter() - live.t0 - live.prefill_s
        text = seq.stops.cut_text(d.tokenizer.decode(seq.generated, skip_special_tokens=True))
        tree = d.tree_name(live.tree, seq.tuner) if live.session is not None else "none"
        stats = GenerationStats.build(seq, live.prefill_s, decode_s, info, tree)
        live.emit(GenerationResult(ids=seq.generated, text=text, finish_reason=seq.finish_reason or "cancelled",
                                   stats=stats))


def _pending(live: _Live) -> RecycledRows | None:
    """The rows `live` has not handed to its session yet: its last tree step's, then its plain steps'
    (for a token in both, the later row wins)."""
    if not live.plain:
        return live.recycled
    topk = torch.stack([r for _, r in live.plain])  # [m, K]
    tokens = torch.tensor([t for t, _ in live.plain], dtype=torch.long, device=topk.device)  # [m]
    live.plain = []
    if live.recycled is not None:
        tokens, topk = torch.cat([live.recycled.tokens, tokens]), torch.cat([live.recycled.topk, topk])
    return _latest_rows(tokens, topk)


def _latest_rows(tokens: torch.Tensor, topk: torch.Tensor) -> RecycledRows:
    """tokens [m], topk [m, K] in step order -> one row per token: a repeated token's latest."""
    winners = select_rows(tokens, list(range(tokens.shape[0])))
    return RecycledRows(tokens[winners], topk[winners])
