"""A transformers checkpoint (safetensors in bfloat16, float16 or float32) quantized once at load into the
kernels' block formats (`--quantize`), so it takes the compressed kernels and, for the families the
native forward takes, the native forward, instead of float32 oneDNN at 4 bytes a weight.

The model is built on the meta device and filled layer by layer (engine/model/direct.py): each linear
weight is read from the safetensors (plain reads: `_File`), encoded into GGUF blocks (kernels/kencode.py:
gguf-py's Q8_0/Q5_0 quantizers, our Q4_K/Q6_K encoders) and decoded into the kernels' blocks
(kernels/kquants.py); the rest (embeddings, norms, biases) becomes float32. The blocks are written to
the cache under the checkpoint's identity and the format, and read back by later loads. A weight that
already is exact 4/8-bit blocks (a checkpoint written from such a file) is held as those blocks, not
quantized again.

Formats (`QUANTIZE`), as llama.cpp's types and its fallbacks for rows that are not whole super-blocks:
  q8_0: Q8_0 (8.5 bits per weight)
  q6_k: Q6_K (6.56), Q8_0 where a row is not a multiple of 256
  q4_k: Q4_K (4.5), Q5_0 where a row is not a multiple of 256; the LM head Q6_K (as llama.cpp's
        Q4_K_M keeps its output tensor)
  none: the float weights as transformers loads them (engine/model/loader.py's float path)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...core.errors import FailedPrecondition
from .choices import QUANTIZE_DEFAULT
from .direct import trim
from .phi3 import as_llama, partial_attention, partial_factor  # noqa: F401 - as_llama re-exported

log = logging.getLogger("trserve.engine")

# format -> (linear layers' type, the LM head's type)
FORMATS = {"q8_0": ("Q8_0", "Q8_0"), "q6_k": ("Q6_K", "Q6_K"), "q4_k": ("Q4_K", "Q6_K")}
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # rows not whole super-blocks of 256 (llama.cpp's choice)
ENCODING = 1  # bumped when an encoder changes what it writes: cached blocks of another version are not read


def resolve_quantize(quantize: str) -> str:
    """What a configured format runs as: auto -> the measured default (choices.QUANTIZE_DEFAULT)."""
    return QUANTIZE_DEFAULT if quantize == "auto" else quantize


def layer_type(fmt: str, in_features: int, head: bool) -> str | None:
    """The GGUF type a linear layer of `in_features` inputs is quantized to (None: kept float, rows that
    are not whole blocks of 32)."""
    kind = FORMATS[fmt][1 if head else 0]
    if in_features % 256:
        kind = FALLBACK.get(kind, kind)
    return kind if in_features % 32 == 0 else None


def _files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(path.glob("*.safetensors"))


def identity(path: Path) -> str:
    """A checkpoint's identity for the cache: each weights file's name, size, modification time and
    safetensors header (its tensors' names, dtypes, shapes and offsets)."""
    h = hashlib.sha256()
    for f in _files(path):
        st = f.stat()
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}:".encode() + fh.read(min(n, 1 << 24)))
    return h.hexdigest()[:16]


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class _File:
    """A safetensors file's tensors read with plain reads, not memory-mapped: a mapped file's pages count
    in the process's resident memory once read (a 1.7B bf16 checkpoint's quantizing load peaked at 6.1 GB
    mapped, against its 2.6 GB result), so a load holds only what it keeps."""

    def __init__(self, path: Path) -> None:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(n))
        self.header.pop("__metadata__", None)
        self.path, self.base = path, 8 + n

    def keys(self):
        return self.header.keys()

    def read(self, name: str, a: int | None = None, b: int | None = None) -> torch.Tensor:
        """Tensor `name` (rows [a, b) of it), in its own dtype."""
        h = self.header[name]
        dtype = _DTYPES.get(h["dtype"])
        if dtype is None:
            raise FailedPrecondition(f"checkpoint tensor {name} is {h['dtype']}: this server quantizes BF16, F16 and "
                                     "F32 checkpoints (pre-quantized ones: use their GGUF file)")
        shape, (start, _) = h["shape"] or [1], h["data_offsets"]
        row = int(np.prod(shape[1:], dtype=np.int64)) * torch.tensor([], dtype=dtype).element_size()
        a, b = a or 0, shape[0] if b is None else b
        buf = bytearray((b - a) * row)
        with self.path.open("rb") as f:
            f.seek(self.base + start + a * row)
            f.readinto(buf)
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        return t.reshape(b - a, *shape[1:]) if h["shape"] else t.reshape(())


class CheckpointWeights:
    """A safetensors checkpoint's tensors by parameter name: float32 tensors, or a linear weight's kernel
    blocks in format `fmt` (quantized now, or read from the cache folder `store`)."""

    def __init__(self, path: Path, model, fmt: str, store: Path, rows: dict | None = None) -> None:
        self.fmt, self.store = fmt, store
        self.rows = rows or {}  # a parameter that is rows [a, b) of another tensor: name -> (tensor, a, b)
        self.where = {name: h for h in (_File(f) for f in _files(path)) for name in h.keys()}
        names = {id(m): n for n, m in model.named_modules()}
        self.head = names.get(id(model.get_output_embeddings()))
        embed = names.get(id(model.get_input_embeddings()))
        tied = f"{self.head}.weight" not in self.where and embed and f"{embed}.weight" in self.where
        self.alias = {f"{self.head}.weight": f"{embed}.weight"} if tied else {}  # the head reads the embedding
        self.quantized = 0
        self.label, self.linears, self.progress = f"quantize {path.name} to {fmt}", len(
            [m for m in model.modules() if isinstance(m, nn.Linear)]), None

    def release(self) -> None:
        trim()

    def float_linears(self, model) -> int:
        return sum(layer_type(self.fmt, m.in_features, n == self.head) is None
                   for n, m in model.named_modules() if isinstance(m, nn.Linear))

    def embedding(self, module_name: str, module: nn.Embedding):
        return None  # float32 rows, read whole (`floats`)

    def floats(self, name: str) -> torch.Tensor:
        src, a, b = self.rows.get(name, (self.alias.get(name, name), None, None))
        if src not in self.where:
            raise FailedPrecondition(f"the checkpoint has no tensor {src}")
        return self.where[src].read(src, a, b).to(torch.float32).contiguous()

    def blocks(self, name: str, out_f: int, in_f: int):
        """A linear weight's kquants.Blocks in the format's type for it, or None where it stays float."""
        kind = layer_type(self.fmt, in_f, name == f"{self.head}.weight")
        if kind is None:
            return None
        cached = self.store / f"{name}.npz"
        if cached.is_file():
            try:
                with np.load(cached) as z:
                    return (int(z["kind"]), z["codes"], z["d"], z["m"] if "m" in z else None)
            except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:  # unreadable: quantized again
                log.warning("cached blocks %s unreadable (%s): quantizing again", cached, e)
        w = self.floats(name)
        if tuple(w.shape) != (out_f, in_f):
            raise FailedPrecondition(f"checkpoint tensor {name} is {tuple(w.shape)}; the model wants {(out_f, in_f)}")
        found = _exact_blocks(w)
        b = found if found is not None else _quantize(kind, w.numpy(), out_f, in_f)
        del w
        self._save(cached, b)
        self.quantized += 1
        self._step()
        return b

    def _step(self) -> None:
        from ...core.progress import Progress

        if self.progress is None:
            self.progress = Progress(self.label, total=self.linears, unit="layers")
        self.progress.step()
        if self.progress.done >= self.progress.total:
            self.progress.close()

    def _save(self, path: Path, b) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"kind": np.array(b[0]), "codes": b[1], "d": b[2], **({} if b[3] is None else {"m": b[3]})}
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)  # whole or absent: a load that dies mid-write leaves no half layer


def _exact_blocks(w: torch.Tensor):
    """The blocks `w` [O, I] float32 already is (exact Q4_1/Q4_0 or Q8_0: kernels/recover.py), or None."""
    from .kernels.recover import recover_q4, recover_q8

    if recover_q4(w[:8]) is None and recover_q8(w[:8]) is None:
        return None  # the first rows already are not: no pass over the whole weight
    q4 = recover_q4(w)
    if q4 is not None:
        return (4, *(t.numpy() for t in q4))
    q8 = recover_q8(w)
    return None if q8 is None else (8, q8[0].view(torch.uint8).numpy(), q8[1].numpy(), None)


def _quantize(kind: str, w: np.ndarray, out_f: int, in_f: int, rows: int = 4096):
    """float32 [O, I] -> kquants.Blocks of GGUF type `kind`, encoded `rows` rows at a time."""
    from .gguf_file import _decode_rows
    from .kernels.kencode import encode

    raw = np.concatenate([encode(kind, w[i:i + rows]) for i in range(0, out_f, rows)])
    return _decode_rows(kind, raw, out_f, in_f)


def checkpoint_quantized(config, device: torch.device, dtype: torch.dtype) -> tuple[str, str] | None:
    """(kernel variant, format) where `config` (loader.ModelConfig) takes this path: a local directory of
    safetensors, a CPU float32 model, kernels auto or compressed that run here (under auto, not their
    scalar variant), quantize not none; else None (transformers' float path)."""
    from .kernels.build import kernel_isa

    fmt = resolve_quantize(config.quantize)
    path = Path(config.source)
    if fmt == "none" or device.type != "cpu" or dtype != torch.float32 or \
            config.kernels not in ("auto", "compressed") or not path.is_dir() or not _files(path):
        return None
    try:
        isa = kernel_isa()
    except (OSError, RuntimeError) as e:
        log.warning("checkpoint not quantized: the compressed kernels do not build here (%s)", e)
        return None
    return None if isa == "scalar" and config.kernels == "auto" else (isa, fmt)


def load_checkpoint(config, fmt: str, isa: str, cache_dir: Path, fingerprint_of):
    """(model, tokenizer, kernels, arithmetic) for a checkpoint quantized to `fmt` on kernel variant `isa`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .attention import use_grouped_sdpa, with_attention
    from .direct import fill
    from .native import native_unsupported
    from .packed import pack_linears

    from .sources import check_model_dir

    path = Path(config.source)
    check_model_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    source_config = AutoConfig.from_pretrained(path)
    model_config, rows = as_llama(source_config, native=config.forward != "transformers")
    store = cache_dir / "quantized" / f"{fmt}-e{ENCODING}-{identity(path)}"
    # auto: exact. int8 over a quantized checkpoint missed the fidelity rule the formats were chosen by
    # (docs/kernels.md, "Checkpoints quantized at load"); asked for by name, it runs
    probe = {"auto": "exact", "int8": "int8!"}.get(config.arithmetic, config.arithmetic)
    label = f"checkpoint {path.name} quantized to {fmt}"
    try:
        with torch.device("meta"):
            model = with_attention(lambda a: AutoModelForCausalLM.from_config(model_config, dtype=torch.float32,
                                                                              attn_implementation=a))
        if rows and partial_factor(model_config) != 1.0:
            partial_attention(model)
        weights = CheckpointWeights(path, model, fmt, store, rows)
        _, arithmetic = fill(model, tokenizer, weights, cache_dir, isa, probe, fingerprint_of, label)
    except FailedPrecondition as e:  # buffers only transformers' loader builds (materialize refuses them)
        log.info("%s: built by transformers' loader first, in float32 (%s)", path.name, e)
        model = with_attention(lambda a: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                              attn_implementation=a))
        weights = CheckpointWeights(path, model, fmt, store)
        _, arithmetic = fill(model, tokenizer, weights, cache_dir, isa, probe, fingerprint_of, label)
    why = native_unsupported(model)
    if why and arithmetic == "int8":  # int8 keeps TR == AR bit for bit on the native forward only
        log.warning("%s: int8 arithmetic without the native forward (%s): TR is not guaranteed to equal plain "
                    "decoding", path.name, why)
    if weights.quantized:
        log.info("checkpoint %s: %d linear layers quantized to %s, cached in %s", path.name, weights.quantized,
                 fmt, store)
    trim()
    kernels = "compressed+packed" if pack_linears(model) else "compressed"
    use_grouped_sdpa(model)
    model.source_config = source_config  # the fingerprint's (loader.model_fingerprint): as `model-spec` reads it
    return model, tokenizer, kernels, arithmetic
