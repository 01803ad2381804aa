"""Shared fixtures: the real SmolLM2 model (converted once), tiny random llamas, and data prompts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from trserve.core.datasets import prompt_file

REPO = Path(__file__).resolve().parent.parent
PROMTOOL = REPO / ".cache" / "tools" / "promtool"


@pytest.fixture(scope="session")
def promtool() -> str:
    """Prometheus' own checker: `make test` fetches it (tests/fetch_promtool.sh). Where it could not be
    fetched the test skips, except under CI=true, where a missing promtool fails."""
    found = shutil.which("promtool") or (str(PROMTOOL) if PROMTOOL.exists() else None)
    if found is None:
        message = f"no promtool on PATH or at {PROMTOOL}: run tests/fetch_promtool.sh {PROMTOOL}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def load_prompts(name: str) -> list[dict]:
    """A bundled prompt set (core/data/), as question dicts."""
    return [json.loads(line) for line in prompt_file(name).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def loaded_smollm2():
    """The real default model with this installation's kernels (compressed on x86-64 CPUs) in the exact
    arithmetic: the one whose greedy output is transformers' own (the served default, int8, is
    `decoder_int8`'s; every test of TR == AR runs in both)."""
    from trserve.engine.model.loader import ModelConfig, load_model

    return load_model(ModelConfig(arithmetic="exact"))


@pytest.fixture(scope="session")
def decoder(loaded_smollm2):
    from trserve.engine import Decoder, DecoderConfig

    return Decoder(DecoderConfig(), loaded=loaded_smollm2)


@pytest.fixture(scope="session")
def decoder_int8():
    """The real default model on the int8 arithmetic (skipped where the compressed kernels cannot run)."""
    from trserve.engine import Decoder, DecoderConfig
    from trserve.engine.model.kernels.build import qlinear_supported
    from trserve.engine.model.loader import ModelConfig

    if not qlinear_supported():
        pytest.skip("the int8 arithmetic needs the compressed kernels (x86-64 Linux)")
    return Decoder(DecoderConfig(model=ModelConfig(arithmetic="int8", kernels="compressed")))


@pytest.fixture(scope="session")
def decoder_served(request):
    """The decoder in the arithmetic a worker serves by default (`--arithmetic auto`): int8 where the
    compressed kernels run as `auto` takes them (not on their scalar variant), else exact."""
    from trserve.engine.model.kernels.build import kernel_isa, qlinear_supported

    served_int8 = qlinear_supported() and kernel_isa() != "scalar"
    return request.getfixturevalue("decoder_int8" if served_int8 else "decoder")


@pytest.fixture(scope="session")
def hf_reference():
    """SmolLM2 with stock kernels: the reference for plain greedy `generate`."""
    from trserve.engine.model.loader import ModelConfig, load_model

    return load_model(ModelConfig(kernels="stock"))


def tiny_llama(vocab_size: int = 128, attn: str = "sdpa", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).eval()


class DigitsTokenizer:
    """Stand-in tokenizer for tiny models: ids as text (a decoder only decodes)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def tiny_decoder(vocab_size: int, seed: int, batch_step: str = "eager", **config):
    """A Decoder over a tiny random llama with peaked next-token laws (drafts get accepted)."""
    from trserve.engine import Decoder, DecoderConfig
    from trserve.engine.model.loader import LoadedModel

    model = tiny_llama(vocab_size=vocab_size, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    loaded = LoadedModel(model, DigitsTokenizer(), f"tiny-v{vocab_size}", "tiny", torch.device("cpu"), torch.float32,
                         "stock", batch_step=batch_step)
    return Decoder(DecoderConfig(k=8, **config), loaded=loaded)
