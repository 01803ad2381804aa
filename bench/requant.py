"""A GGUF file re-quantized to another block type, with gguf-py (no llama.cpp build needed):
`python -m trserve.bench.requant SRC.gguf DST.gguf Q4_0`.

Every quantized 2-D weight of SRC whose rows split into the new type's blocks is dequantized
as ggml does and quantized again into the type asked, as `llama-quantize --allow-requantize` would
for the block types gguf-py can write (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants Q4_K, Q5_K, Q6_K
(engine/model/kernels/kencode.py: valid blocks, simpler scale choices than llama-quantize's). A tensor whose
rows do not split into 256-weight super-blocks takes llama-quantize's fallback (Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0). Norms and other 1-D tensors stay as they are; the metadata (tokenizer,
chat template) is copied. The tests and the bench make the files a user would bring from the bundled
model this way."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

WRITABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama-quantize's, for rows not of 256
FILE_TYPES = {"Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K"}


def _quantize(rows: np.ndarray, to: str) -> tuple[np.ndarray, str]:
    """rows [n, I] float32 -> (bytes, type): `to`'s blocks, or its fallback where I is no multiple of 256."""
    from gguf import quants
    from gguf import GGMLQuantizationType as T

    from ..engine.model.kernels.kencode import ENCODERS

    if to in ("F16", "F32"):  # left unquantized, as llama-quantize can leave a tensor
        return rows.astype(np.float16 if to == "F16" else np.float32), to
    if to not in WRITABLE:  # another type gguf-py writes (BF16, TQ2_0, MXFP4, ...): a file trserve refuses
        return quants.quantize(rows, T[to]), to
    if to in ENCODERS:
        if rows.shape[-1] % 256 == 0:
            return ENCODERS[to](rows), to
        to = FALLBACK[to]
    return quants.quantize(rows, T[to]), to


def requantize(src: Path, dst: Path, qtype: str, others: dict[str, str] | None = None) -> Path:
    """`others`: another type for the tensors whose name holds a key (a mixed file, as llama-quantize's
    _M types write: e.g. {"ffn_down": "Q5_1"}; any type gguf-py writes, F16/BF16/F32 included)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    others = others or {}
    if qtype not in WRITABLE or set(others.values()) - set(WRITABLE) - set(T.__members__):
        raise ValueError(f"requant writes {', '.join(WRITABLE)} blocks; {qtype!r} needs llama.cpp's llama-quantize")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES.get(qtype, f"MOSTLY_{qtype}")])  # as llama.cpp names it
    out = []
    floats = (T.F32, T.F16, T.BF16)
    for t in reader.tensors:
        data, kind = t.data, t.tensor_type
        if kind not in floats:  # a quantized weight: to the type asked where its rows split into its blocks
            rows = quants.dequantize(data, kind)
            to = next((o for key, o in others.items() if key in t.name), qtype)
            if rows.ndim == 2 and rows.shape[-1] % 32 == 0:
                data, name = _quantize(rows.astype(np.float32), to)
                kind = T[name]
        out.append((t.name, data, kind))
    for name, data, kind in out:  # a quantized tensor's shape in bytes: the writer reads it back in weights
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in out:
        writer.write_tensor_data(data)
    writer.close()
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("type", choices=WRITABLE)
    args = ap.parse_args(argv)
    print(requantize(Path(args.src), Path(args.dst), args.type))
    return 0


if __name__ == "__main__":
    sys.exit(main())
