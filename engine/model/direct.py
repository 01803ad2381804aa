"""A model built on the meta device and filled from a weights source, layer by layer, onto the compressed
kernels: a GGUF file read as it is (engine/model/gguf_file.py: GGUFWeights) or a transformers checkpoint
quantized at load (engine/model/checkpoint.py: CheckpointWeights). Only the non-linear parameters
(embeddings, norms, biases) and the linears a source holds as floats become float32 tensors; every other
linear goes from its blocks to a QLinear one layer at a time, so a load holds about the kernels' bytes
per weight, never a float32 copy of the model.

A weights source answers: `blocks(name, out, in)` (kquants.Blocks, or None for a float linear),
`floats(name)` (a float32 tensor), `embedding(name, module)` (a module reading rows lazily, or None),
`float_linears(model)` (how many linears stay float) and `release()` (its pages and freed heap back).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ...core.errors import FailedPrecondition
from .rope_factors import apply_rope_factors

log = logging.getLogger("trserve.engine")


def trim() -> None:
    """Give freed heap memory back to the system (glibc): decoding a layer frees tens of MB of numpy
    temporaries, which glibc keeps in its heap; without this a 1.7B Q4_K_M file's load peaked at 6.5 GB
    resident and held 5.1 GB after it, against 2.2 GB trimmed."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LOAD_MMAP_THRESHOLD = 1 << 20  # a load's temporaries above this go to mmap, back to the system when freed
DYNAMIC_MAX = 32 << 20  # glibc's own ceiling for its sliding threshold (64-bit)


def _mmap_threshold(size: int) -> None:
    """Allocations of `size` bytes and more mapped apart (glibc; elsewhere nothing). glibc's default
    threshold slides up to the largest block freed so far, so a load's tens of MB temporaries, freed
    and made again in other sizes, come from the heap and fragment it: a 1.7B Q4_K_M file's calibrating
    first load grew by 0.36 GB in its calibration prompts and peaked at 2.03 GB; with 1 MiB, 0.11 GB
    and 1.83 GB (the load's own peak, measured on an AVX2 host)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(M_MMAP_THRESHOLD, size)
    except (OSError, AttributeError):
        pass


def fill(model, tokenizer, weights, cache_dir: Path, isa: str, arithmetic: str, fingerprint_of,
         label: str) -> tuple[int, str]:
    """Fill the meta-device `model` from `weights`: (float linears left as nn.Linear for the caller to
    pack, the arithmetic taken). int8 (kept inputs calibrated on the exact model where no cached set
    exists, cached under the model's calibration key, outliers.py:calibration_key: a property of the
    model's activations, shared by its files and formats) only where no linear is float, unless asked for
    by name ("int8!"); else exact."""
    _mmap_threshold(LOAD_MMAP_THRESHOLD)
    try:
        return _fill(model, tokenizer, weights, cache_dir, isa, arithmetic, fingerprint_of, label)
    finally:
        _mmap_threshold(DYNAMIC_MAX)


def _fill(model, tokenizer, weights, cache_dir: Path, isa: str, arithmetic: str, fingerprint_of,
          label: str) -> tuple[int, str]:
    """fill, under the load's mmap threshold."""
    from .kernels.outliers import attach_key_pairs, calibrated, calibration_key, kept_inputs, key_pairs

    fixed = materialize(model, weights)
    floats = weights.float_linears(model)
    if arithmetic == "int8" and floats:
        log.warning("%d linear layers of %s are float tensors: no native forward, exact arithmetic", floats, label)
        arithmetic = "exact"
    kept = pairs = None
    if arithmetic.startswith("int8"):  # kept inputs: cached, or calibrated once on the exact model
        key = calibration_key(fingerprint_of(tokenizer, model.config), model)  # the norms are filled by now
        if not calibrated(key, cache_dir, model):
            swap_linears(model, weights, cache_dir, isa, "exact", None)
        kept = kept_inputs(model, tokenizer, key, cache_dir)
        pairs = key_pairs(model, tokenizer, key, cache_dir)
    swap_linears(model, weights, cache_dir, isa, arithmetic.rstrip("!"), kept)
    if pairs:
        attach_key_pairs(model, pairs)
    trim()
    log.info("%s: %d float tensors, %d float linear layers", label, fixed, floats)
    model.eval()
    return floats, arithmetic.rstrip("!")


def swap_linears(model, weights, cache_dir: Path, isa: str, arithmetic: str, kept) -> int:
    """Every linear layer from the file's blocks onto a QLinear in `arithmetic` (replacing what is there,
    one layer at a time, each old one freed before its replacement is built: only names are held across
    the loop, so a second pass over an exact model never holds both forms of a layer); float tensors as float32
    nn.Linear. Returns how many stayed float."""
    from .kernels.qlinear import QLinear

    floats = 0
    size = {n: m.in_features * m.out_features for n, m in model.named_modules() if isinstance(m, (nn.Linear, QLinear))}
    names = sorted(size, key=lambda n: -size[n])  # the largest first: its temporaries on the least
    weights.release()  # what ran before (a calibration) gives its freed heap back first
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, child_name)
        bias, in_f, out_f = child.bias, child.in_features, child.out_features
        if isinstance(child, QLinear):  # a second pass: the exact layer goes before its new form is built
            setattr(parent, child_name, nn.Identity())  # (else a 1.7B's head: 100 MB held twice)
            child = None
        blocks = weights.blocks(f"{name}.weight", out_f, in_f)
        weights.release()  # the file's pages just read: the blocks are a copy
        bias = None if bias is None else (weights.floats(f"{name}.bias") if bias.is_meta else bias)
        if blocks is None:
            if isinstance(child, nn.Linear) and child.weight.is_meta:
                child.weight = nn.Parameter(weights.floats(f"{name}.weight"), requires_grad=False)
                child.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
            floats += 1
            continue
        kind, codes, d, m = blocks
        new = QLinear(kind, torch.from_numpy(codes), torch.from_numpy(d), None if m is None else torch.from_numpy(m),
                      bias, in_f, out_f, cache_dir, isa, arithmetic)
        if kept and kept.get(name):
            dims = torch.tensor(kept[name], dtype=torch.int32)
            new.keep_inputs(dims, kept_columns(blocks, dims.long()))
        del child, bias
        setattr(parent, child_name, new)
        del blocks, new
        weights.release()
    return floats


def kept_columns(blocks, dims: torch.Tensor, rows: int = 512) -> torch.Tensor:
    """W[:, dims] as [k, O] float32 from a layer's blocks, rebuilt `rows` outputs at a time (a head of
    49,152 x 2,048 rebuilt whole would take 1.2 GB for a moment)."""
    from .kernels.kquants import rebuild

    kind, codes, d, m = blocks
    parts = [rebuild((kind, codes[i:i + rows], d[i:i + rows], None if m is None else m[i:i + rows]))[:, dims]
             for i in range(0, codes.shape[0], rows)]
    return torch.cat(parts).t().contiguous()


def materialize(model, weights) -> int:
    """The non-linear parameters (embeddings, norms) from the file, the rotary tables recomputed (and
    Gemma's embedding scale set, a buffer transformers fills from an attribute when it loads); returns
    how many tensors were read. Linear layers stay on the meta device for swap_linears."""
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding) and child.weight.is_meta:
                table = weights.embedding(f"{parent_name}.{child_name}" if parent_name else child_name, child)
                if table is not None:
                    setattr(parent, child_name, table)
                    count += 1
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, nn.Linear):
            continue
        for pname, p in list(parent.named_parameters(recurse=False)):
            if p.is_meta:
                full = f"{parent_name}.{pname}" if parent_name else pname
                setattr(parent, pname, nn.Parameter(weights.floats(full), requires_grad=False))
                count += 1
    for module in model.modules():  # Gemma's scaled embedding: its scale a buffer, its value an attribute
        scale = getattr(module, "scalar_embed_scale", None)
        if isinstance(getattr(module, "embed_scale", None), torch.Tensor) and module.embed_scale.is_meta and \
                isinstance(scale, float):
            module.embed_scale = torch.tensor(scale)  # as transformers' _init_weights fills it (float32)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if any(b.is_meta for b in child.buffers(recurse=False)) and not isinstance(child, nn.Linear):
                try:
                    setattr(parent, child_name, type(child)(config=model.config))  # e.g. the rotary embedding
                except TypeError:  # built from other arguments: left on the meta device, refused below
                    pass
    apply_rope_factors(model)  # a Llama 3.x file's (engine/model/rope_factors.py), on the rebuilt tables
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise FailedPrecondition(f"the model's buffers {left[:3]} cannot be built outside transformers' loader")
    return count
