"""`trserve bench --profile`: its two modes run on one engine, so each must be its own tenant there."""

from trserve.bench.cli import DEFAULT_PROMPTS
from trserve.bench.profile import ProfileConfig, _profile_one
from trserve.bench.runner import select_questions


def test_profile_modes_never_reuse_each_others_prompts(loaded_smollm2):
    """`ar` runs first, then `tr` on the same prompts and engine: with one tenant, `tr` prefilled every
    prompt for free from `ar`'s prefix cache entries (41 against 4 ms a prompt in one profile), so its
    tok/s looked far above `ar`'s. Each mode is its own tenant now: each reuses only what its own warm-up
    left (the chat template's system turn, which every prompt shares), the same for both."""
    questions = select_questions(DEFAULT_PROMPTS, 1)[:2]
    config = ProfileConfig(prompts=DEFAULT_PROMPTS, n_prompts=2, max_new_tokens=8, widths=(1, 2), kv=32)
    out = _profile_one(loaded_smollm2, config, questions)
    ar, tr = out["modes"]["ar"], out["modes"]["tr"]
    assert ar["tokens"] > 0 and tr["tokens"] > 0
    assert tr["cached_prompt_tokens"] == ar["cached_prompt_tokens"], (ar, tr)
