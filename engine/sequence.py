"""One request in flight: its prepared request and everything about it that changes per step."""

from __future__ import annotations

from trserve.engine.request.request import PreparedRequest
from trserve.engine.request.stops import StopChecker
from trserve.engine.tr.logprobs import TokenLogprob
from trserve.engine.tr.rules import LogitRules
from trserve.engine.tr.lookup import ContextLookup
from trserve.engine.tr.sampling import Sampler
from trserve.engine.tuning.online import OnlineTuner
from trserve.engine.tuning.records import AcceptanceLog


class Sequence:
    """Committed tokens, stop/length bookkeeping and the per-request drafting helpers."""

    def __init__(self, prepared: PreparedRequest, stops: StopChecker, sampler: Sampler | None,
                 log: AcceptanceLog | None = None, tuner: OnlineTuner | None = None, device=None) -> None:
        self.prepared = prepared
        self.stops = stops
        self.sampler = sampler
        self.log = log  # per-step records for the caller's tree optimiser
        self.tuner = tuner  # adaptive tree: plans each step, records exploration steps
        self.lookup: ContextLookup | None = None  # prompt + output so far, for hybrid drafting (TR only)
        self.generated: list[int] = []
        self.accepted_per_step: list[int] = []
        # per draft source (engine/step.py:SOURCES): draft tokens verified, and of those accepted
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
        if self.lookup is not None:
            self.lookup.extend(kept)
        return kept

    def __repr__(self) -> str:
        return (f"Sequence(prompt={self.prompt_len}, generated={len(self.generated)}/{self.max_new_tokens}, "
                f"finish={self.finish_reason!r})")
