"""One request in flight, the only object per request: its prepared request, what it committed, and
what the engine, the scheduler and its draft method hold for it while it runs, in named parts
(Caller, Place, Drafting)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..core.errors import TRServeError

from .request.request import PreparedRequest
from .request.stops import StopChecker
from .request.text import TextStream
from .tr.logprobs import TokenLogprob
from .tr.rules import LogitRules
from .tr.lookup import ContextLookup
from .tr.recycle import RecycledRows
from .tr.sampling import Sampler
from .tr.seeding import PromptSeeding
from .tr.source import DraftSession
from .tr.tree import CompiledTree
from .tuning.online import OnlineTuner
from .tuning.records import AcceptanceLog

log = logging.getLogger("trserve.engine")


@contextmanager
def alone(seq: Sequence) -> Iterator[None]:
    """Around a request's own part of an engine step (its drafting, its choice, accept and commit, its
    prefill): an exception there ends `seq` alone (Sequence.fail; the engine retires it after the step
    and its caller gets the exception), and the requests beside it go on."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - the request's caller maps it to a status
        if isinstance(exc, TRServeError):
            log.info("a request ended alone: %s", exc)
        else:
            log.exception("a request failed in its own part of a step; the requests beside it go on")
        seq.fail(exc)


@dataclass
class Caller:
    """Who waits for a request in the engine: where its chunks and result go, and what ends it early."""

    emit: Callable | None = None  # its StepChunks, then its GenerationResult (or the exception of a failed step)
    cancelled: Callable[[], bool] | None = None
    deadline: float | None = None  # time.monotonic() it must end by
    deltas: bool = True  # its StepChunks carry text (False: a caller reading only the result's)
    text: TextStream | None = None  # the deltas' state, while they are sent
    t0: float = field(default_factory=time.perf_counter)

    def ends(self, ahead: float = 0.0) -> str | None:
        """"cancelled", "time_limit" (past the deadline, or past it `ahead` seconds from now), or None."""
        if self.cancelled is not None and self.cancelled():
            return "cancelled"
        if self.deadline is not None and time.monotonic() + ahead > self.deadline:
            return "time_limit"
        return None


@dataclass
class Place:
    """A request's KV row and its prompt's prefill progress (the scheduler's and the engine's)."""

    row: int = -1  # its KV row while admitted
    done: int = 0  # prompt tokens prefilled
    cached: int = 0  # of those, taken from the prefix cache (engine/prefix_cache.py)
    prefill_s: float = 0.0
    prefill_token_s: float = 0.0  # seconds per token of its last prefill chunk (0 before the first)
    prefill_chunks_left: int = 0  # chunks of its prompt still to prefill, and steps since its last
    prefill_waited: int = 0  # chunk while it prefills (the scheduler's fair order: scheduler.py)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A chunk of `tokens` prompt tokens went in, in `seconds`."""
        self.done += tokens
        self.prefill_token_s = seconds / tokens


@dataclass
class Drafting:
    """What a TR request drafts from and owes: its tree, its draft session, the proposer drafting it and
    that proposer's own state, and the rows its steps recycled that its session has not taken yet."""

    tree: CompiledTree | None = None  # the tree it drafts (None: plain decoding)
    tuner: OnlineTuner | None = None  # adaptive tree: plans each step, records exploration steps
    log: AcceptanceLog | None = None  # per-step records for the caller's tree optimiser
    rates_key: tuple = ("", None)  # (tenant, tree template): whose acceptance rates its drafts use and feed
    session: DraftSession | None = None  # None for plain decoding
    lookup: ContextLookup | None = None  # prompt + output so far, for hybrid drafting (TR only)
    proposer: object = None  # the draft method drafting it this step (engine/drafting/proposers/); None: plain
    state: object = None  # what that proposer keeps for it (e.g. proposers/grown.py:Trust); theirs only
    seeding: PromptSeeding | None = None  # its prompt seeding while it prefills (tr/seeding.py)
    recycled: RecycledRows | None = None  # its last tree step's rows, not yet with its session
    plain: list = field(default_factory=list)  # (root, its top-k [K], their probs [K]) of plain steps since

    def take_rows(self) -> tuple[RecycledRows | None, list]:
        """The rows it owes its session (its last tree step's, its plain steps'); it owes none after."""
        rows = self.recycled, self.plain
        self.recycled, self.plain = None, []
        return rows


class Sequence:
    """One request in the engine: its prepared request, its sampling and rules, the tokens it committed
    and their stop/length bookkeeping, and three parts: `caller` (emit, cancellation, deadline),
    `place` (KV row, prefill progress) and `drafting` (tree, session, proposer and its state, rows owed)."""

    def __init__(self, prepared: PreparedRequest, stops: StopChecker, sampler: Sampler | None,
                 log: AcceptanceLog | None = None, tuner: OnlineTuner | None = None, device=None, *,
                 emit: Callable | None = None, tree: CompiledTree | None = None,
                 cancelled: Callable[[], bool] | None = None, deadline: float | None = None,
                 rates_key: tuple = ("", None), deltas: bool = True) -> None:
        self.prepared = prepared
        self.stops = stops
        self.sampler = sampler
        self.generated: list[int] = []
        self.accepted_per_step: list[int] = []
        # per draft source (engine/drafting/step.py:SOURCES): draft tokens verified, and of those accepted
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.draft_steps = 0  # steps that verified at least one draft token
        req = prepared.request  # its logit rules (engine/tr/rules.py), None without: the raw argmax
        # its structured output (engine/tr/grammar.py): this sequence's own grammar state, None without
        self.grammar = prepared.grammar.matcher() if prepared.grammar is not None else None
        self.rules = LogitRules.of(req, prepared.stop_ids, prepared.ids, device or "cpu", self.grammar)
        self.logprobs: list | None = [] if prepared.request.logprobs is not None else None  # per generated token
        # per prompt token, where asked; the first has no logprob (nothing predicts it)
        self.prompt_logprobs: list | None = (
            [TokenLogprob(prepared.ids[0], None)] if prepared.request.prompt_logprobs is not None else None)
        self.finish_reason: str | None = None
        self.error: Exception | None = None  # what ended it alone (its grammar, its rules): its caller gets it
        self.root = 0  # the last committed token: the next tree's root
        self.caller = Caller(emit, cancelled, deadline, deltas)
        self.place = Place()
        self.drafting = Drafting(tree, tuner, log, rates_key)

    @property
    def tenant(self) -> str:
        return self.drafting.rates_key[0]

    @property
    def reserved(self) -> int:
        """KV tokens it may take: prompt, new tokens and its widest tree step."""
        tree = self.drafting.tree
        width = tree.template.max_width if tree is not None else 1
        return self.prompt_len + self.max_new_tokens + width

    def stopping(self, ahead: float = 0.0) -> bool:
        """Finished, or cancelled / past its deadline, or past it `ahead` seconds from now (what its
        next step would take): then its finish reason is set here."""
        if self.finish_reason is None:
            self.finish_reason = self.caller.ends(ahead)
        return self.finish_reason is not None

    def fail(self, exc: Exception) -> None:
        """Something of this request's own (its grammar or rules, its logprobs) cannot go on: it ends
        alone, its caller gets `exc`, and the requests beside it go on."""
        self.error = exc
        self.finish_reason = "error"

    @property
    def prompt_len(self) -> int:
        return len(self.prepared.ids)

    @property
    def max_new_tokens(self) -> int:
        return self.prepared.request.max_new_tokens

    def commit(self, new: list[int]) -> list[int]:
        """Append what fits (stops, length) and set the finish reason; returns the kept tokens. A
        finished sequence keeps nothing more."""
        if self.finish_reason is not None:
            return []
        verdict = self.stops.check(self.generated, new)
        keep, reason = verdict.keep, verdict.reason
        room = self.max_new_tokens - len(self.generated)
        if self.grammar is not None:  # a complete grammar ends the output where it completed
            took = self.grammar.take(new[: min(keep, room)])
            if self.grammar.done:
                keep, reason = took, "grammar"
        kept = new[:keep]
        if len(kept) >= room:
            kept = kept[:room]
            self.finish_reason = reason if keep <= room and reason else "length"
        elif reason:
            self.finish_reason = reason
        self.generated.extend(kept)
        if self.drafting.lookup is not None:
            self.drafting.lookup.extend(kept)
        return kept

    def __repr__(self) -> str:
        return (f"Sequence(prompt={self.prompt_len}, generated={len(self.generated)}/{self.max_new_tokens}, "
                f"finish={self.finish_reason!r})")
