"""Exact compressed linear layers for CPU: weights that came from a 4/8-bit block quantisation.

A float32 checkpoint dequantised from GGUF Q4_1 / Q8_0 (the builtin SmolLM2 is one) holds weights
that are exactly `q * d + m` per block of 32 (q 4-bit, d and m float16) or `q * d` (q int8). Reading
those as float32 moves 4 bytes per weight through memory on every forward; on a 2-core CPU that is
most of a narrow forward. `recover_q4` / `recover_q8` find (q, d, m) and check that rebuilding them
gives the stored float32 weight *bit for bit*; `quantize_linears` then swaps each such `nn.Linear`
for a `QLinear` whose AVX-512 kernel (csrc/qlinear.c) rebuilds the same weights in registers
(0.75 / 1.06 bytes per weight). Same weights, so the same model; like any kernel change, sums are
taken in a different order than stock (logits differ by ~1e-5). Tree and plain decoding both use
these kernels, and each output element is computed identically whatever the number of rows.
Layers whose weights do not recover exactly keep their previous kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("trserve.engine")

_SOURCE = Path(__file__).with_name("csrc") / "qlinear.c"
_lib = None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def qlinear_supported() -> bool:
    """Linux x86-64 with the AVX-512 subsets the kernel is built for (the library itself is built or
    found by `build_kernels`)."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and {"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"} <= _cpu_flags())


def _compiler() -> str | None:
    from shutil import which

    return os.environ.get("CC") or which("gcc") or which("cc")


# Portable across AVX-512 CPUs (an image built on one host runs on another), not -march=native.
_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def build_kernels(cache_dir: Path | None = None) -> Path:
    """Compile csrc/qlinear.c once per source version into `cache_dir`/kernels; returns the library."""
    from engine.model.paths import default_cache_dir

    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    out = Path(cache_dir or default_cache_dir()) / "kernels" / f"qlinear-{key}.so"
    if not out.exists():
        if _compiler() is None:
            raise RuntimeError("no C compiler (gcc) to build the compressed kernels")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [_compiler(), *_CFLAGS, "-o", tmp, str(_SOURCE)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {_SOURCE.name} failed: {res.stderr.strip()[:500]}")
        os.chmod(tmp, 0o755)  # mkstemp makes it private; other users (a container's) must load it
        os.replace(tmp, out)  # atomic: concurrent loaders see a whole library or none
    return out


def _library(cache_dir: Path):
    global _lib
    if _lib is not None:
        return _lib
    lib = ctypes.CDLL(str(build_kernels(cache_dir)))
    fn = lib.trserve_qlinear
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int]
    _lib = fn
    return fn


# ---- exact recovery of block-quantised weights (pure tensor functions) ---------------------------
def _fp16_candidates(v: torch.Tensor, steps: int):
    """v rounded to float16, then its float16 neighbours 1..steps ulps away (positive, finite), as float32."""
    bits = v.to(torch.float16).view(torch.int16).to(torch.int32)
    for s in [0] + [x for k in range(1, steps + 1) for x in (-k, k)]:
        b = (bits + s).clamp(0, 0x7BFF).to(torch.int16)
        yield b.view(torch.float16).to(torch.float32)


def recover_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """w: [O, I] float32, I % 32 == 0 -> (codes [O, I/2] uint8, d [O, I/32], m [O, I/32]) or None.

    Each block of 32 must be exactly q * d + m (q in 0..15, d and m float16 values). Codes pack
    q_j in the low and q_{j+16} in the high nibble of byte j of the block.
    """
    O, I = w.shape
    if I % 32 or O % 2 or w.dtype != torch.float32:  # the kernel takes blocks of 32 and output pairs
        return None
    blocks = w.reshape(O, I // 32, 32)
    m = blocks.amin(-1)  # [O, nb] the q = 0 element
    if not torch.equal(m.to(torch.float16).to(torch.float32), m):
        return None
    span = blocks.amax(-1) - m  # ~ 15 d
    best_q, best_d, ok_all = None, None, torch.zeros_like(m, dtype=torch.bool)
    for d in _fp16_candidates(span / 15, 2):  # the exact scale is span / 15 up to rounding
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((blocks - m[..., None]) / safe[..., None]).clamp(0, 15)
        q = torch.where((d > 0)[..., None], q, torch.zeros_like(q))
        ok = ((q * d[..., None] + m[..., None]) == blocks).all(-1) & ~ok_all
        best_q = q if best_q is None else torch.where(ok[..., None], q, best_q)
        best_d = d if best_d is None else torch.where(ok, d, best_d)
        ok_all |= ok
        if bool(ok_all.all()):
            break
    if not bool(ok_all.all()):
        return None
    q = best_q.to(torch.uint8)  # [O, nb, 32]
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(O, I // 2)
    return codes.contiguous(), best_d.contiguous(), m.contiguous()


def recover_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w: [O, I] float32 -> (codes [O, I] int8, d [O, I/32]) with every block exactly q * d, or None."""
    O, I = w.shape
    if I % 32 or O % 2 or w.dtype != torch.float32:  # the kernel takes blocks of 32 and output pairs
        return None
    blocks = w.reshape(O, I // 32, 32)
    d = blocks.abs().amax(-1) / 127  # the |q| = 127 element gives d exactly
    if not torch.equal(d.to(torch.float16).to(torch.float32), d):
        return None
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(blocks / safe[..., None]).clamp(-128, 127)
    if not torch.equal(q * d[..., None], blocks):
        return None
    return q.to(torch.int8).reshape(O, I).contiguous(), d.contiguous()


# ---- the module -----------------------------------------------------------------------------
class QLinear(nn.Module):
    """`nn.Linear` replacement over exactly recovered 4-bit (kind 4) or 8-bit (kind 8) blocks."""

    def __init__(self, kind: int, codes, d, m, bias, in_features: int, out_features: int, cache_dir: Path) -> None:
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("d", d, persistent=False)
        self.register_buffer("m", m if m is not None else torch.zeros(0), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self._fn = _library(cache_dir)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()  # [n, I]
        if x2.dtype != torch.float32:
            raise TypeError(f"QLinear takes float32 input, got {x2.dtype}")
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        bias = self.bias.data_ptr() if self.bias is not None else None
        m = self.m.data_ptr() if self.kind == 4 else None
        self._fn(self.kind, x2.data_ptr(), x2.shape[0], self.in_features, self.out_features, self.codes.data_ptr(),
                 self.d.data_ptr(), m, bias, y.data_ptr(), torch.get_num_threads())
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, exact q{self.kind} blocks"


def quantize_linears(model: nn.Module, cache_dir: Path) -> tuple[int, int]:
    """Swap every nn.Linear whose weight recovers exactly; returns (swapped, kept)."""
    swapped = kept = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            w = child.weight.detach()
            bias = child.bias.detach().contiguous() if child.bias is not None else None
            q4 = recover_q4(w)
            if q4 is not None:
                new = QLinear(4, *q4, bias, child.in_features, child.out_features, cache_dir)
            else:
                q8 = recover_q8(w)
                if q8 is None:
                    kept += 1
                    continue
                new = QLinear(8, q8[0].view(torch.uint8), q8[1], None, bias, child.in_features, child.out_features,
                              cache_dir)
            setattr(module, name, new)
            swapped += 1
    log.info("exact compressed kernels: %d linear layers swapped, %d kept", swapped, kept)
    return swapped, kept
