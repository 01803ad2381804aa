"""A GGUF file re-quantized to another block type, with gguf-py (no llama.cpp build needed):
`python -m trserve.bench.requant SRC.gguf DST.gguf Q4_0`.

Every quantized 2-D weight of SRC whose rows split into the new type's blocks is dequantized
as ggml does and quantized again into the type asked, as `llama-quantize --allow-requantize` would
for the block types gguf-py can write: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0. Norms and other 1-D tensors
stay as they are; the metadata (tokenizer, chat template) is copied. The tests and the bench make the
files a user would bring from the bundled model this way (the K-quants need llama.cpp's own
`llama-quantize`: gguf-py has no encoder for them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

WRITABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def requantize(src: Path, dst: Path, qtype: str, others: dict[str, str] | None = None) -> Path:
    """`others`: another type for the tensors whose name holds a key (a mixed file, as llama-quantize's
    _M types write: e.g. {"ffn_down": "Q5_1"})."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    others = others or {}
    if qtype not in WRITABLE or set(others.values()) - set(WRITABLE):
        raise ValueError(f"gguf-py writes {', '.join(WRITABLE)} blocks; {qtype!r} needs llama.cpp's llama-quantize")
    target = T[qtype]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"])  # what the file now holds (llama.cpp names it so)
    out = []
    floats = (T.F32, T.F16, T.BF16)
    for t in reader.tensors:
        data, kind = t.data, t.tensor_type
        if kind not in floats:  # a quantized weight: to the type asked where its rows split into its blocks
            rows = quants.dequantize(data, kind)
            to = next((T[o] for key, o in others.items() if key in t.name), target)
            if rows.ndim == 2 and rows.shape[-1] % gguf.GGML_QUANT_SIZES[to][0] == 0:
                data, kind = quants.quantize(rows.astype(np.float32), to), to
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
