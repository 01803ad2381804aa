"""Results and statistics of one generation."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepChunk:
    """Tokens committed by one decoding step and the text they add."""

    tokens: list[int]
    text: str
    logprobs: tuple | None = None  # per token, engine/tr/logprobs.py:TokenLogprob, where the request asked


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    steps: int  # decoding forwards after the prefill
    accepted_per_step: list[int] = field(repr=False)  # tokens committed per step (drafted matches + bonus)
    mat: float  # mean accepted tokens per step
    prefill_s: float
    decode_s: float
    tokens_per_s: float  # generated tokens / (prefill + decode) wall time
    matrix_version: int | None  # version of the matrix that drafted the last step
    matrix_epoch: int | None  # the tenant's writer epoch of that version (None: a private copy, or unknown)
    draft_mode: str  # local, embedded, remote, replica, local-fallback, or none (plain decoding)
    tree: str
    # per draft source ("matrix", "context": the request's own tokens, "history": the tenant's earlier
    # requests): draft tokens verified, and of those accepted (the root and bonus tokens are in neither)
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (engine/prefix_cache.py)
    draft_steps: int = 0  # steps that verified at least one draft token (vLLM's "drafts")

    @classmethod
    def build(cls, seq, prefill_s: float, decode_s: float, info, tree: str, cached_tokens: int = 0) -> GenerationStats:
        """From a finished engine.sequence.Sequence and its draft session's DraftInfo (None for AR)."""
        steps = len(seq.accepted_per_step)
        total = prefill_s + decode_s
        return cls(
            prompt_tokens=seq.prompt_len,
            generated_tokens=len(seq.generated),
            steps=steps,
            accepted_per_step=list(seq.accepted_per_step),
            mat=sum(seq.accepted_per_step) / steps if steps else 0.0,
            prefill_s=prefill_s,
            decode_s=decode_s,
            tokens_per_s=len(seq.generated) / total if total > 0 else 0.0,
            matrix_version=info.matrix_version if info else None,
            matrix_epoch=info.matrix_epoch if info else None,
            draft_mode=info.mode if info else "none",
            tree=tree,
            drafted=dict(seq.drafted),
            accepted=dict(seq.accepted),
            cached_tokens=cached_tokens,
            draft_steps=seq.draft_steps,
        )


@dataclass(frozen=True)
class GenerationResult:
    ids: list[int]  # generated ids (a final stop token id included, as transformers does)
    text: str  # decoded without special tokens, cut before any stop string
    finish_reason: str  # length, eos, stop, cancelled, time_limit
    stats: GenerationStats
    logprobs: tuple | None = None  # per generated id, TokenLogprob (engine/tr/logprobs.py), where asked
    prompt_logprobs: tuple | None = None  # per prompt id, TokenLogprob (the first's logprob None), where asked
