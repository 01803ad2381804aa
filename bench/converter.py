"""llama.cpp's own checkpoint converter (`convert_hf_to_gguf.py`), from the same llama-cpp-python sdist
as the peers' tools (bench/llama_server.py): how most GGUF files users bring were made, so the tests
and the bench read its files, not only our writer's (bench/shaped.py).

Only its Python parts are kept (`convert_hf_to_gguf.py`, `conversion/`, and the `gguf-py` it imports
before any installed gguf), ~2 MB, in ~/.cache/trserve/llama-server/<version>/convert/, taken from the
sdist alone (pip download, no build) where they are missing: by `make peers` (`python -m
trserve.bench.converter fetch`) and by the first test or bench run that converts. The converter needs
sentencepiece for the Llama family's vocabulary step (requirements.txt).

    python -m trserve.bench.converter CHECKPOINT_DIR OUT.gguf [--outtype q8_0|bf16|f16|f32]
    python -m trserve.bench.converter fetch
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # under the sdist's vendor/llama.cpp/


def converter_dir(cache_dir: Path | None = None) -> Path:
    from .llama_server import server_dir

    return server_dir(cache_dir) / "convert"


def fetch_converter(cache_dir: Path | None = None) -> Path:
    """converter_dir, taken from the llama-cpp-python sdist (pip download, ~75 MB, no build) if missing."""
    from .llama_server import LLAMA_CPP_SPEC

    out = converter_dir(cache_dir)
    if (out / PARTS[0]).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", LLAMA_CPP_SPEC, "--no-binary", ":all:", "--no-deps",
                        "-q", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            wanted = [m for m in tar.getmembers() if _wanted(m.name)]
            tar.extractall(tmp, members=wanted, filter="data")
        src = next(Path(tmp).glob("*/vendor/llama.cpp"))
        kept = Path(tempfile.mkdtemp(prefix="convert.", dir=out.parent))
        for part in PARTS:
            os.rename(src / part, kept / part)
        try:
            os.rename(kept, out)  # atomic: a converter dir is whole or absent
        except OSError:  # another process kept them first
            shutil.rmtree(kept, ignore_errors=True)
    return out


def _wanted(member: str) -> bool:
    parts = member.split("/")
    return len(parts) > 3 and parts[1:3] == ["vendor", "llama.cpp"] and parts[3] in PARTS


def convert(checkpoint: Path, dst: Path, outtype: str = "q8_0", cache_dir: Path | None = None) -> Path:
    """`checkpoint` (a transformers directory) written to GGUF file `dst` by llama.cpp's converter."""
    script = fetch_converter(cache_dir) / PARTS[0]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py, as shipped
    done = subprocess.run([sys.executable, str(script), str(checkpoint), "--outtype", outtype, "--outfile", str(dst)],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {checkpoint}: {done.stderr.strip()[-800:]}")
    return dst


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["fetch"]:  # make peers: the converter beside the tools
        print(fetch_converter())
        return 0
    parser = argparse.ArgumentParser(prog="python -m trserve.bench.converter", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--outtype", default="q8_0", choices=("q8_0", "bf16", "f16", "f32"))
    args = parser.parse_args(argv)
    print(convert(args.checkpoint, args.out, args.outtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
