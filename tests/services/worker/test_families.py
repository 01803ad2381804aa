"""Issue 57, item 4: every checkpoint family through a real worker. A tiny random bfloat16 checkpoint of
each family (tests/engine/model/test_checkpoint.py:_tiny), quantized at load onto the native forward,
served on a loopback port and called through the Python client: TR == AR, a stream == the unary reply,
requests sent together (a batch of TR, AR and streams) == each alone, in the exact arithmetic and in
int8; Mistral with a sliding window shorter than every prompt, and Gemma 2 and Gemma 3 with it on their
local layer (layer_types: a sliding layer, then a global one), so that each reply is decoded past it.
Beside them a Gemma 3 GGUF file read as it is (bench/shaped.py's gemma3-tiny as Q4_K_M: five local layers,
then a global one) in auto's int8. Random weights give arbitrary text: the token ids are compared."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from trserve.engine import Decoder, DecoderConfig
from trserve.engine.model.kernels.build import qlinear_supported
from trserve.engine.model.loader import ModelConfig
from trserve.engine.model.paths import default_cache_dir
from trserve.services.worker.config import Limits, WorkerConfig
from trserve_client import Client
from trserve_client.client import Chunk, Reply, Stream, build_request
from tests.conftest import load_prompts
from tests.engine.model.test_checkpoint import _tiny
from tests.services.worker_harness import BackgroundWorker, serving

pytestmark = pytest.mark.skipif(not qlinear_supported(), reason="the compressed kernels need x86-64 Linux")

TOKENS = 32
WINDOW = 16  # the sliding window (Mistral's, Gemma's local layer's): shorter than every prompt
FORMATS = {"llama": "q4_k", "llama3": "q8_0", "qwen2": "q6_k", "qwen3": "q8_0", "mistral": "q4_k", "phi3": "q8_0",
           "gemma2": "q6_k", "gemma3": "q4_k"}
WINDOWS = {"mistral": [WINDOW, WINDOW], "gemma2": [WINDOW, 0], "gemma3": [WINDOW, 0]}  # per layer; others [0, 0]
FILES = {"gemma3-file": ("gemma3-tiny", "Q4_K_M")}  # a GGUF file (bench/shaped.py): its blocks served as they are
WINDOWS["gemma3-file"] = [WINDOW] * 5 + [0]  # bench/shaped.py:GEMMA_KEYS: gemma3-tiny's window is WINDOW
CASES = [(family, arithmetic) for family in FORMATS for arithmetic in ("exact", "int8")] + [("gemma3-file", "int8")]
LIMITS = Limits(max_new_tokens_cap=64, default_max_new_tokens=TOKENS, max_prompt_tokens=1024)
MESSAGES = [[{"role": "user", "content": q["turns"][0]}] for q in load_prompts("spec_bench")[2:18:4]]


@dataclass
class Served:
    family: str
    arithmetic: str
    worker: BackgroundWorker
    client: Client
    alone: dict = field(default_factory=dict)  # (mode, prompt index) -> its Reply, each request sent alone

    def ask(self, i: int, mode: str) -> Reply:
        """Prompt i decoded to TOKENS tokens (through EOS: a random model may draw it), one unary call."""
        return Reply.of(self.client.stub.Generate(_request(i, mode), timeout=120))

    def stream(self, i: int) -> list[Chunk]:
        return list(Stream(self.client.stub.GenerateStream(_request(i, "tr"), timeout=120)))

    def alone_reply(self, i: int, mode: str) -> Reply:
        if (mode, i) not in self.alone:
            self.alone[mode, i] = self.ask(i, mode)
        return self.alone[mode, i]


def _request(i: int, mode: str):
    return build_request(messages=MESSAGES[i], max_new_tokens=TOKENS, mode=mode, tenant="family",
                         return_token_ids=True, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's checkpoint (FILES: its GGUF file), built once for the module (both arithmetics read
    the same one)."""
    from trserve.bench.shaped import make_shaped

    made: dict[str, object] = {}

    def get(family: str):
        if family in FILES and family not in made:
            shape, mix = FILES[family]
            made[family] = make_shaped(shape, mix, tmp_path_factory.mktemp(family) / f"{shape}-{mix}.gguf")
        elif family not in made:
            made[family] = _tiny(tmp_path_factory.mktemp(family), family, WINDOW if family in WINDOWS else None)
        return made[family]
    return get


@pytest.fixture(scope="module")
def quantize_cache(tmp_path_factory):
    """A fresh cache for the quantized blocks and int8 calibrations; the kernel library is the default
    cache's (as every default-loaded model's, built there once per source version, not again here)."""
    cache = tmp_path_factory.mktemp("quantized")
    kernels = default_cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    return cache


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{a}" for f, a in CASES])
def served(request, checkpoints, quantize_cache):
    family, arithmetic = request.param
    config = ModelConfig(source=str(checkpoints(family)), quantize=FORMATS.get(family, "auto"), arithmetic=arithmetic,
                         cache_dir=str(quantize_cache))
    decoder = Decoder(DecoderConfig(model=config))
    assert (decoder.loaded.forward, decoder.loaded.arithmetic) == ("native", arithmetic)
    worker_config = WorkerConfig(port=0, metrics_port=None, limits=LIMITS, max_batch=16, max_queue=16,
                                 prefill_chunk=32)  # prompts of 52-114 tokens prefilled in chunks, past the window
    for worker in serving(worker_config, decoder):
        with Client(worker.addr, timeout=120) as client:
            yield Served(family, arithmetic, worker, client)


def test_the_worker_serves_the_family_on_the_native_forward(served):
    info = served.client.model_info()
    assert (info.arithmetic, info.quantize, info.kernels) == (served.arithmetic, FORMATS.get(served.family, "none"),
                                                              "compressed")
    windows = served.worker.worker.engine.runner.native.windows
    assert windows == WINDOWS.get(served.family, [0, 0])
    if served.family == "phi3":  # split into the Llama it computes, still phi3's to the matrices
        assert info.fingerprint.startswith("phi3-")


def test_tr_equals_ar(served):
    """TR on the tenant's cold matrix (random text repeats nothing: next to no draft is accepted), then
    again on the matrix that learnt it: most steps accept several tokens, and the ids are AR's."""
    for i in range(len(MESSAGES)):
        ar, tr = served.alone_reply(i, "ar"), served.alone_reply(i, "tr")
        assert len(ar.token_ids) == TOKENS and ar.finish_reason == "length"
        assert tr.token_ids == ar.token_ids, (served.family, served.arithmetic, i)
        assert tr.text == ar.text
        assert (tr.stats.draft_mode, ar.stats.draft_mode) == ("embedded", "none")
        if served.family in WINDOWS:  # decoded past the window: its first keys leave a sliding layer's view
            assert tr.stats.prompt_tokens > WINDOW
        warm = served.ask(i, "tr")
        assert warm.token_ids == ar.token_ids, (served.family, served.arithmetic, i, "warm")
        assert warm.stats.mean_accepted_tokens > 2 and warm.stats.cached_prompt_tokens > 0


def test_a_stream_equals_the_unary_reply(served):
    """On the warm matrix: chunks of several tokens (a step's accepted path) among them."""
    widest = 0
    for i in range(len(MESSAGES)):
        chunks = served.stream(i)
        widest = max(widest, *(len(c.token_ids) for c in chunks))
        unary = served.alone_reply(i, "tr")
        assert [t for c in chunks for t in c.token_ids] == unary.token_ids, (served.family, served.arithmetic, i)
        assert "".join(c.text for c in chunks) == unary.text
        assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert widest > 1


def test_requests_sent_together_equal_each_alone(served):
    """TR, AR and a TR stream of every prompt at once: they share forwards (several rows running at
    some step), TR accepts several tokens a step in the batch, and each gives what it gives alone."""
    calls = [(i, mode) for i in range(len(MESSAGES)) for mode in ("tr", "ar", "stream")]
    alone = {(i, m): served.alone_reply(i, m) for i in range(len(MESSAGES)) for m in ("tr", "ar")}
    scheduler, peak, done = served.worker.worker.engine.scheduler, [0], threading.Event()

    def watch():
        while not done.wait(0.002):
            peak[0] = max(peak[0], len(scheduler.running))

    def call(c):  # (ids, stats)
        i, mode = c
        if mode == "stream":
            chunks = served.stream(i)
            return [t for chunk in chunks for t in chunk.token_ids], chunks[-1].stats
        reply = served.ask(i, mode)
        return reply.token_ids, reply.stats

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            together = list(pool.map(call, calls))
    finally:
        done.set()
        watcher.join(5)
    for (i, mode), (ids, _) in zip(calls, together):
        expected = alone[i, "tr" if mode == "stream" else mode].token_ids
        assert ids == expected, (served.family, served.arithmetic, i, mode)
    assert peak[0] >= 2
    assert max(stats.mean_accepted_tokens for (_, mode), (_, stats) in zip(calls, together) if mode != "ar") > 1.5
