"""A GGUF file served as it is: the model built on the meta device from the file's config, every linear
layer's blocks read from the memory-mapped file straight onto the compressed kernels, and only the
rest (norms, biases, float16/32 linears) dequantized to float32, the token embedding row by row as
it is first looked up (engine/model/embedding.py). No float32 copy of the
weights is made or written to the cache, so a worker holds about the kernels' bytes per weight
(docs/kernels.md) instead of 4, and loads in seconds.

It serves the Llama family's files (llama.cpp's `llama`, `qwen2` and `qwen3` architectures: Llama,
Mistral, Qwen2, Qwen3 with its per-head q/k norms), Gemma's (`gemma2`, `gemma3`: the text model, its
hyperparameters read as llama.cpp reads them, engine/model/gguf_gemma.py; its norms stored as 1 + w,
taken back to w as transformers does; its tied embedding scaled by sqrt(hidden)) and Phi-3's (`phi3`,
split into the Llama it computes as it is read, engine/model/gguf_phi3.py) on CPU where the
compressed kernels run; anything else takes the conversion path
(engine/model/loader.py:gguf_model_dir). The weights are the ones transformers would load from the
file (its own name map and row order: `get_gguf_hf_weights_map`, `TENSOR_PROCESSORS`), and each
block type's decoder equals gguf-py's dequantization bit for bit (tests/engine/model/test_kquants.py).
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...core.errors import FailedPrecondition
from .direct import trim
from .gguf_gemma import GEMMA_ARCHS, gemma_config
from .gguf_phi3 import phi3_config
from .rope_factors import file_rope_factors

log = logging.getLogger("trserve.engine")

ARCHS = ("llama", "qwen2", "qwen3", *GEMMA_ARCHS, "phi3")  # general.architecture values this path serves


FLOATS = ("F32", "F16", "BF16")


class GGUFWeights:
    """The file's tensors by transformers' parameter names, as float32 tensors or kernel blocks."""

    def __init__(self, path: Path, model, arch: str, rows: dict | None = None, names_model=None) -> None:
        """`rows`: a parameter of `model` that is rows [a, b) of another, fused, tensor (name -> (its
        name, a, b): Phi-3 split into a Llama, gguf_phi3.py), whose names `names_model` has."""
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map)

        self.reader = GGUFReader(str(path))  # memory-mapped: a tensor's bytes are read when used
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
        self.names = {hf: name for name, hf in get_gguf_hf_weights_map(names_model or model, self.processor).items()}
        self.rows = rows or {}
        head = next((f"{n}.weight" for n, m in model.named_modules() if m is model.get_output_embeddings()), None)
        if head and self.names.get(head) not in self.tensors and "token_embd.weight" in self.tensors:
            # tied: the head reads the embedding's blocks (gguf-py maps no output tensor for Gemma at all)
            self.names[head] = "token_embd.weight"

    def release(self) -> None:
        """The file's pages read so far out of this process's resident set (they are clean: read again
        from the page cache if needed), and freed heap memory back to the system."""
        import mmap

        mapped = getattr(self.reader.data, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)
        trim()

    def float_linears(self, model) -> int:
        """How many of `model`'s linear layers the file holds as float tensors (F32/F16/BF16)."""
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        return sum(self.tensor(f"{n}.weight")[1].tensor_type.name in FLOATS for n in names)

    def tensor(self, hf_name: str):
        name = self.names.get(self.rows.get(hf_name, (hf_name,))[0])
        if name is None or name not in self.tensors:
            raise FailedPrecondition(f"the GGUF file has no tensor for {hf_name} (looked for {name})")
        return name, self.tensors[name]

    def floats(self, hf_name: str) -> torch.Tensor:
        """A tensor dequantized to float32 as gguf-py does, in transformers' row order."""
        from gguf import quants

        name, t = self.tensor(hf_name)
        _, lo, hi = self.rows.get(hf_name, (None, None, None))
        w = quants.dequantize(t.data[lo:hi], t.tensor_type).astype(np.float32, copy=False)
        w = np.ascontiguousarray(self.processor.process(weights=w, name=name).weights)
        return torch.from_numpy(w if w.flags.writeable else w.copy())  # F32 tensors are the file's read-only map

    def embedding(self, module_name: str, module: nn.Embedding):
        """`module` as a FileEmbedding over the file's rows (engine/model/embedding.py; with Gemma's scale
        where `module` is its scaled embedding), or None where the file holds it in float32 or
        transformers reorders its rows (then `floats` as for the rest)."""
        from .embedding import FileEmbedding

        name, t = self.tensor(f"{module_name}.weight")
        num, dim = module.num_embeddings, module.embedding_dim
        order = self.processor.process(weights=np.arange(num).reshape(num, 1), name=name).weights[:, 0]
        if t.tensor_type.name == "F32" or not np.array_equal(order, np.arange(num)) or t.data.shape[0] != num:
            return None
        return FileEmbedding(t.data, t.tensor_type, num, dim, getattr(module, "scalar_embed_scale", None))

    def blocks(self, hf_name: str, out_f: int, in_f: int):
        """A linear weight's kernel blocks (kquants.Blocks) in transformers' row order, or None for a float
        tensor (F32/F16/BF16); FailedPrecondition for a block type the kernels do not take."""
        from .kernels.kquants import BLOCK_BYTES

        name, t = self.tensor(hf_name)
        kind = t.tensor_type.name
        if kind in FLOATS:
            return None
        if kind not in BLOCK_BYTES:
            raise FailedPrecondition(f"tensor {name} is {kind}: this server reads Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                                     f"Q4_K, Q5_K, Q6_K and F16/BF16/F32 tensors; re-quantize the file to one of those")
        _, lo, hi = self.rows.get(hf_name, (None, None, None))
        b = _decode_rows(kind, np.asarray(t.data)[lo:hi], out_f, in_f)
        order = self.processor.process(weights=np.arange(out_f).reshape(out_f, 1), name=name).weights[:, 0]
        if np.array_equal(order, np.arange(out_f)):
            return b
        return (b[0], np.ascontiguousarray(b[1][order]), np.ascontiguousarray(b[2][order]),
                None if b[3] is None else np.ascontiguousarray(b[3][order]))


def _decode_rows(kind: str, raw: np.ndarray, O: int, I: int, rows: int = 4096):
    """kquants.decode of a tensor's bytes [O, row bytes], `rows` rows at a time into arrays allocated once:
    its temporaries stay a chunk's (a 49,152-row head decoded whole took 0.47 GB beyond its blocks)."""
    from .kernels.kquants import decode

    if O <= rows:
        return decode(kind, raw, O, I)
    first = decode(kind, raw[:rows], rows, I)
    out = [None if a is None else np.empty((O, *a.shape[1:]), a.dtype) for a in first[1:]]
    for i in range(0, O, rows):
        part = first if i == 0 else decode(kind, raw[i:i + rows], min(rows, O - i), I)
        for dst, src in zip(out, part[1:]):
            if dst is not None:
                dst[i:i + rows] = src
    return (first[0], *out)


def file_blocks(path: str, model) -> dict:
    """For a model transformers loaded from GGUF file `path` (the conversion path): module name -> the
    kernels' blocks of each linear layer the file holds in a block type, where they rebuild the loaded
    float32 weight bit for bit (a layer that does not keeps its float kernel, and is said)."""
    from .kernels.kquants import rebuild

    try:
        weights = GGUFWeights(Path(path), model, architecture(Path(path)))
    except (NotImplementedError, ValueError, KeyError):  # an architecture gguf-py or transformers does not map
        return {}
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        try:
            blocks = weights.blocks(f"{name}.weight", module.out_features, module.in_features)
        except FailedPrecondition:  # no such tensor, or a type the kernels do not take: its float kernel
            continue
        if blocks is not None and torch.equal(rebuild(blocks), module.weight.detach()):
            out[name] = blocks
        elif blocks is not None:
            log.warning("%s: the file's blocks do not rebuild the loaded weight; kept in float32", name)
    return out


def metadata(path: Path) -> dict:
    """The file's metadata by key, string arrays (the vocabulary, the merges) as their lengths:
    transformers' GGUF reader walks them, where gguf-py's GGUFReader builds every string's field parts
    (~2 s for the bundled vocabulary on these CPUs, once per call)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    return read_gguf_metadata(str(path))[0]


def architecture(path: Path) -> str:
    return str(metadata(path).get("general.architecture", ""))


def file_config(path: Path):
    """transformers' config of GGUF file `path`, with the head dim its GGUF mapping leaves out for Qwen3:
    `qwen3.attention.key_length` (llama.cpp's convert_hf_to_gguf.py writes config.head_dim there), which
    transformers reads for qwen3_moe but not for qwen3, whose config then keeps Qwen3Config's default of
    128 whatever the file's heads are; a Gemma 2/3 file's hyperparameters as llama.cpp reads them
    (engine/model/gguf_gemma.py: attention scale, windows, soft-capping, rope bases); a Llama 3.x file's
    rotary factors (engine/model/rope_factors.py) and a Phi-3 file's longrope, partial rotary and window
    (engine/model/gguf_phi3.py), which transformers' reader drops."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    meta = metadata(path)
    arch = str(meta.get("general.architecture", ""))
    if config.model_type == "qwen3" and "qwen3.attention.key_length" in meta:
        config.head_dim = int(meta["qwen3.attention.key_length"])
    factors = file_rope_factors(path, meta) if arch == "llama" else None  # Llama 3.x's rope scaling
    if factors:
        config.rope_freq_factors = factors  # engine/model/rope_factors.py
    if arch in GEMMA_ARCHS:
        return gemma_config(config, meta, arch)
    return phi3_config(config, meta, path) if arch == "phi3" else config


def load_file(path: Path, cache_dir: Path, isa: str, arithmetic: str, fingerprint_of):
    """(model, tokenizer, floats, arithmetic): the file's model with every block-quantized linear on the
    compressed kernels, its float linears left as nn.Linear (`floats` of them) for the caller to pack
    (engine/model/direct.py:fill, which also says when int8 is taken)."""
    from transformers import AutoTokenizer

    from .direct import fill
    from .phi3 import as_llama, partial_attention, partial_factor

    arch = architecture(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    source = file_config(path)
    config, rows = as_llama(source) if arch == "phi3" else (source, {})  # Phi-3: the Llama it computes
    model = _meta_model(config)
    names = _meta_model(source) if rows else None  # the fused tensors' names are the Phi-3 model's
    if rows and partial_factor(config) != 1.0:
        partial_attention(model)  # Phi-4-mini: Phi-3's partial rotary on the split Llama's own modules
    weights = GGUFWeights(path, model, arch, rows, names)
    floats, arithmetic = fill(model, tokenizer, weights, cache_dir, isa, arithmetic, fingerprint_of,
                            f"GGUF {path.name} read as it is ({arch}{' as a Llama' if rows else ''})")
    model.source_config = source  # the fingerprint's (loader.model_fingerprint): as `model-spec` reads it
    return model, tokenizer, floats, arithmetic


def _meta_model(config):
    """transformers' model of `config` on the meta device (no weights), float32, its attention as the loader's."""
    from transformers import AutoModelForCausalLM

    from .attention import with_attention

    with torch.device("meta"):
        return with_attention(lambda a: AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                          attn_implementation=a))


def direct_isa(config, device: torch.device, dtype: torch.dtype) -> str | None:
    """The compressed kernels' variant when `config` (loader.ModelConfig) names a GGUF file this path serves
    on this host: a CPU float32 model, kernels auto or compressed, an architecture in ARCHS, and kernels
    that run here (under auto, not the scalar variant); else None (the conversion path)."""
    from .kernels.build import kernel_isa

    if not config.source.endswith(".gguf") or device.type != "cpu" or dtype != torch.float32 or \
            config.kernels not in ("auto", "compressed") or not Path(config.source).is_file():
        return None
    try:
        if architecture(Path(config.source)) not in ARCHS:
            return None
        isa = kernel_isa()
    except (OSError, RuntimeError, ValueError, struct.error):  # not a GGUF file transformers' reader reads
        return None
    return None if isa == "scalar" and config.kernels == "auto" else isa


def load_direct(config, isa: str, cache_dir: Path, fingerprint_of):
    """(model, tokenizer, kernels, arithmetic) for a file direct_isa accepted: its float linears packed for
    oneDNN, grouped attention on. Under auto the arithmetic is int8 where every linear holds blocks (the
    native forward), else exact (as loader._compress decides for converted models)."""
    from .attention import use_grouped_sdpa
    from .packed import pack_linears

    path = Path(config.source)
    probe = {"auto": "int8", "int8": "int8!"}.get(config.arithmetic, config.arithmetic)
    model, tokenizer, floats, arithmetic = load_file(path, cache_dir, isa, probe, fingerprint_of)
    kernels = "compressed+packed" if pack_linears(model) else "compressed"
    use_grouped_sdpa(model)
    return model, tokenizer, kernels, arithmetic
