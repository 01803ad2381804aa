"""Exact compressed linear layers for CPU: weights that came from a 4/8-bit block quantisation.

A float32 checkpoint dequantised from GGUF Q4_1 / Q8_0 (the builtin SmolLM2 is one) holds weights
that are exactly `q * d + m` per block of 32 (q 4-bit, d and m float16) or `q * d` (q int8). Reading
those as float32 moves 4 bytes per weight through memory on every forward; on a 2-core CPU that is
most of a narrow forward. `recover_q4` / `recover_q8` find (q, d, m) and check that rebuilding them
gives the stored float32 weight *bit for bit*; `quantize_linears` then swaps each such `nn.Linear`
for a `QLinear` whose C kernel (csrc/qlinear.c) rebuilds the same weights in registers from 0.625
(Q4) / 1.06 (Q8) bytes per weight (codes plus float16 scales). Same weights, so the same model; like
any kernel change, sums are taken in a different order than stock (logits differ by ~1e-5). Tree
and plain decoding both use these kernels, and each output element is computed identically whatever
the number of rows. Layers whose weights do not recover exactly keep their previous kernel.

The kernel comes in three variants, one library each, picked from /proc/cpuinfo at first use
(`kernel_isa`): AVX-512, AVX2 (+FMA, F16C) and portable scalar C. All three compute every output
element with the same written-out sequence of float32 operations, so they give the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("trserve.engine")

_CSRC = Path(__file__).with_name("csrc")
_SOURCE = _CSRC / "forward.c"  # includes qlinear.c: one library holds the linear kernels and the native forward
_SOURCES = (_CSRC / "pool.h", _CSRC / "qlinear.c", _SOURCE)
_libs: dict[str, ctypes.CDLL] = {}  # isa -> the loaded library
PANEL = 16  # outputs per panel of the packed layout (csrc/qlinear.c)
Q4_LAYOUTS = ("bytes", "lanes")  # the q4 code layouts, by the number trserve_qlinear_q4_layout returns

# Kernel variants, best first: the /proc/cpuinfo flags each needs, and its compile flags. The flags
# are explicit ISA subsets over baseline x86-64 (never -march=native, nor the compiler's default
# -march, which some distributions raise), so a library built on one host runs on any other host
# with those flags, e.g. one built into an image. -ffp-contract=off: the compiler must not fuse or
# split multiply-adds by itself; csrc/qlinear.c writes out every one, the same in all variants.
_ISAS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx512": (frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma", "f16c"}),
               ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-mf16c")),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    "scalar": (frozenset(), ()),
}
ISAS = tuple(_ISAS)
_BASE_CFLAGS = ("-O3", "-march=x86-64", "-mtune=generic", "-ffp-contract=off", "-pthread", "-shared", "-fPIC")


@functools.lru_cache(maxsize=1)  # read once, at first use (not at import); flags do not change
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _x86_64_linux() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def _check_isa(isa: str) -> None:
    if isa != "auto" and isa not in _ISAS:
        raise ValueError(f"isa must be auto or one of {', '.join(ISAS)}; got {isa!r}")


def available_isas() -> list[str]:
    """The kernel variants this host runs, best first ([] off x86-64 Linux; else at least scalar)."""
    if not _x86_64_linux():
        return []
    flags = _cpu_flags()
    return [isa for isa, (needs, _) in _ISAS.items() if needs <= flags]


def kernel_isa(isa: str = "auto") -> str:
    """The variant `isa` resolves to here: "avx512", "avx2" or "scalar" ("auto": the best this CPU
    runs). ValueError for an unknown name, RuntimeError where this host cannot run it."""
    _check_isa(isa)
    runs = available_isas()
    if not runs:
        raise RuntimeError("the compressed kernels need Linux on x86-64")
    if isa == "auto":
        return runs[0]
    if isa not in runs:
        raise RuntimeError(f"this CPU lacks {', '.join(sorted(_ISAS[isa][0] - _cpu_flags()))} for the {isa} kernels")
    return isa


def qlinear_supported(isa: str = "auto") -> bool:
    """Whether this host runs the `isa` kernels: for "auto", any x86-64 Linux host (scalar at worst).
    The library itself is built (needs gcc) or found by `build_kernels`."""
    try:
        kernel_isa(isa)
    except RuntimeError:
        return False
    return True


def _compiler() -> str | None:
    from shutil import which

    return os.environ.get("CC") or which("gcc") or which("cc")


def _cflags(isa: str) -> list[str]:
    return [*_BASE_CFLAGS, *_ISAS[isa][1]]


def kernel_build_key(isa: str) -> str:
    """16 hex digits naming one build of the kernel sources for `isa` (a resolved variant): it changes
    with the sources and the flags, so caches of measured speeds (calibrations) follow the kernels."""
    src = b"".join(p.read_bytes() for p in _SOURCES)
    return hashlib.sha256(src + " ".join(_cflags(isa)).encode()).hexdigest()[:16]


def build_kernels(cache_dir: Path | None = None, isa: str = "auto") -> Path:
    """Compile csrc/forward.c (+ qlinear.c) for `isa` ("auto": this CPU's best) once per source version into
    `cache_dir`/kernels; returns the library. Any variant builds on any x86-64 host (an image can
    hold all three); running it needs the CPU flags."""
    from engine.model.paths import default_cache_dir

    _check_isa(isa)
    isa = kernel_isa() if isa == "auto" else isa
    key = kernel_build_key(isa)
    out = Path(cache_dir or default_cache_dir()) / "kernels" / f"qlinear-{isa}-{key}.so"
    if not out.exists():
        if _compiler() is None:
            raise RuntimeError("no C compiler (gcc) to build the compressed kernels")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [_compiler(), *_cflags(isa), "-o", tmp, str(_SOURCE), "-lm"]
        log.warning("building the compressed kernels for %s (once per source version; ~30-60 s on 2 cores)", isa)
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {_SOURCE.name} for {isa} failed: {res.stderr.strip()[:500]}")
        log.info("built %s in %.1f s", out.name, time.perf_counter() - t0)
        os.chmod(tmp, 0o755)  # mkstemp makes it private; other users (a container's) must load it
        os.replace(tmp, out)  # atomic: concurrent loaders see a whole library or none
    return out


def _library(cache_dir: Path, isa: str):
    """The kernel entry point of variant `isa` (already resolved and runnable here), loaded once."""
    if isa in _libs:
        return _libs[isa].trserve_qlinear
    lib = ctypes.CDLL(str(build_kernels(cache_dir, isa)))
    lib.trserve_qlinear_isa.restype = ctypes.c_char_p
    built = lib.trserve_qlinear_isa().decode()
    if built != isa:  # the source picks its code path from the compile flags
        raise RuntimeError(f"kernel library built for {isa} reports {built}")
    if lib.trserve_qlinear_panel() != PANEL:  # QLinear packs outputs in panels of this size
        raise RuntimeError(f"kernel library panels are not {PANEL} outputs")
    if lib.trserve_qlinear_q4_layout() not in range(len(Q4_LAYOUTS)):
        raise RuntimeError("kernel library reads an unknown q4 code layout")
    fn = lib.trserve_qlinear
    fn.restype = ctypes.c_int  # 0, or -1 when the kernel could not allocate its scale buffers
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int]
    f = lib.trserve_forward
    f.restype = ctypes.c_int
    P, i64 = ctypes.c_void_p, ctypes.c_int64
    f.argtypes = [P, i64, P, P, P, P, P, P, P, P, P, i64, P, i64, P, i64, P, ctypes.c_int]
    _libs[isa] = lib
    return fn


def q4_layout(cache_dir: Path, isa: str) -> str:
    """The q4 code layout ("bytes" or "lanes", csrc/qlinear.c) the `isa` library reads."""
    _library(cache_dir, isa)
    return Q4_LAYOUTS[_libs[isa].trserve_qlinear_q4_layout()]


def forward_library(isa: str):
    """trserve_forward of variant `isa` (csrc/forward.c), from the library its QLinear layers loaded."""
    if isa not in _libs:
        raise RuntimeError(f"the {isa} kernel library is not loaded (no QLinear built on it)")
    return _libs[isa].trserve_forward


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
    if I % 32 or w.dtype != torch.float32:  # the kernel takes blocks of 32
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
    if I % 32 or w.dtype != torch.float32:  # the kernel takes blocks of 32
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


# ---- the kernels' panel layout (pure tensor functions) ---------------------------------------------
def _pad_outputs(t: torch.Tensor, panels: int) -> torch.Tensor:
    """t: [O, ...] -> [panels * PANEL, ...], the added outputs zero (their weights rebuild to 0)."""
    pad = panels * PANEL - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, layout: str = "bytes"):
    """recover_q4's (codes [O, I/2], d, m [O, I/32]) -> the panel layout of csrc/qlinear.c:
    codes [P, nb, 16, 16] uint8, either "bytes" (byte [p, b, j, l] = q[16p + l, 32b + 2j] |
    q[.., 32b + 2j + 1] << 4) or "lanes" (the 256 bytes of panel-block [p, b] are 4 x 16 little-endian
    uint32, word [g, l] = sum_k q[16p + l, 32b + 8g + k] << 4k); d, m [P, nb, 16] (P = ceil(O / 16)
    panels, padded outputs zero)."""
    if layout not in Q4_LAYOUTS:
        raise ValueError(f"q4 layout must be one of {Q4_LAYOUTS}, got {layout!r}")
    O, nb = d.shape
    P = -(-O // PANEL)
    blk = codes.reshape(O, nb, 16)
    q = torch.cat([blk & 0xF, blk >> 4], dim=-1)  # [O, nb, 32]: input 32b + i
    q = _pad_outputs(q, P).reshape(P, PANEL, nb, 32)  # [P, l, nb, i]
    if layout == "bytes":
        q = q.reshape(P, PANEL, nb, 16, 2)  # [P, l, nb, j, input 2j + k]
        packed = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1)  # [P, nb, j, l]
    else:
        shifts = 4 * torch.arange(8, dtype=torch.int64)  # nibble k of a word: bits 4k .. 4k + 3
        words = (q.reshape(P, PANEL, nb, 4, 8).to(torch.int64) << shifts).sum(-1)  # [P, l, nb, g]
        packed = _le_bytes(words.permute(0, 2, 3, 1)).reshape(P, nb, 16, 16)  # words [P, nb, g, l]
    return packed.contiguous(), _panel_scales(d, P), _panel_scales(m, P)


def _le_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 words [..., n] holding 32-bit values -> their little-endian bytes [..., 4 n] uint8."""
    return torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8).flatten(-2)


def pack_q8(codes: torch.Tensor, d: torch.Tensor):
    """recover_q8's (codes [O, I] int8, d [O, I/32]) -> codes [P, nb, 32, 16] (byte [p, b, j, l] =
    q[16p + l, 32b + j]) and d [P, nb, 16]."""
    O, nb = d.shape
    P = -(-O // PANEL)
    q = _pad_outputs(codes.reshape(O, nb, 32), P).reshape(P, PANEL, nb, 32)
    return q.permute(0, 2, 3, 1).contiguous(), _panel_scales(d, P)


def _panel_scales(s: torch.Tensor, panels: int) -> torch.Tensor:
    """[O, nb] -> [P, nb, 16]: panel p's 16 outputs' scales of block b side by side."""
    nb = s.shape[1]
    return _pad_outputs(s, panels).reshape(panels, PANEL, nb).permute(0, 2, 1).contiguous()


# ---- the module -----------------------------------------------------------------------------
def _half(v: torch.Tensor) -> torch.Tensor:
    """v: float32 scales that are float16 values -> the same values as float16 (exact, checked)."""
    h = v.to(torch.float16)
    if not torch.equal(h.to(torch.float32), v):
        raise ValueError("block scales must be float16 values (as recover_q4 / recover_q8 return them)")
    return h.contiguous()


class QLinear(nn.Module):
    """`nn.Linear` replacement over exactly recovered 4-bit (kind 4) or 8-bit (kind 8) blocks.

    codes: [O, I/2] (kind 4) or [O, I] (kind 8) uint8 as recover_q4 / recover_q8 give them; d, m:
    [O, I/32] float32 holding float16 values (m None for kind 8). Held in the kernels' panel layout
    (`pack_q4` / `pack_q8`), scales as float16; isa: the kernel variant ("auto": this CPU's best)."""

    def __init__(self, kind: int, codes, d, m, bias, in_features: int, out_features: int, cache_dir: Path,
                 isa: str = "auto") -> None:
        super().__init__()
        if kind not in (4, 8) or in_features % 32 or out_features < 1:
            raise ValueError(f"QLinear takes q4/q8 blocks of 32 and at least one output; got q{kind} "
                             f"{in_features} -> {out_features}")
        nb = in_features // 32
        if codes.shape != (out_features, in_features // (2 if kind == 4 else 1)) or d.shape != (out_features, nb):
            raise ValueError(f"codes {tuple(codes.shape)} / scales {tuple(d.shape)} do not match q{kind} "
                             f"{in_features} -> {out_features}")
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.isa = kernel_isa(isa)
        if kind == 4:
            codes, d, m = pack_q4(codes, _half(d), _half(m), q4_layout(cache_dir, self.isa))
        else:
            codes, d = pack_q8(codes, _half(d))
        self.register_buffer("codes", codes, persistent=False)  # [P, nb, 16 or 32, 16] uint8
        self.register_buffer("d", d, persistent=False)  # [P, nb, 16] float16
        self.register_buffer("m", m if kind == 4 else torch.zeros(0, dtype=torch.float16), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self._fn = _library(cache_dir, self.isa)
        self.threads: int | None = None  # the kernels' threads (csrc/pool.h); None: torch.get_num_threads()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()  # [n, I]
        if x2.dtype != torch.float32:
            raise TypeError(f"QLinear takes float32 input, got {x2.dtype}")
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)  # [n, O]
        bias = self.bias.data_ptr() if self.bias is not None else None
        m = self.m.data_ptr() if self.kind == 4 else None
        if self._fn(self.kind, x2.data_ptr(), x2.shape[0], self.in_features, self.out_features, self.codes.data_ptr(),
                    self.d.data_ptr(), m, bias, y.data_ptr(), self.threads or torch.get_num_threads()):
            raise MemoryError("compressed kernel: no memory for its scale buffers")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, exact q{self.kind} blocks, {self.isa}"


def quantize_linears(model: nn.Module, cache_dir: Path, isa: str = "auto") -> tuple[int, int]:
    """Swap every nn.Linear whose weight recovers exactly for a QLinear on kernel variant `isa`
    ("auto": this CPU's best; others for tests and measurements); returns (swapped, kept)."""
    isa = kernel_isa(isa)
    swapped = kept = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            w = child.weight.detach()
            bias = child.bias.detach().contiguous() if child.bias is not None else None
            q4 = recover_q4(w)
            if q4 is not None:
                new = QLinear(4, *q4, bias, child.in_features, child.out_features, cache_dir, isa)
            else:
                q8 = recover_q8(w)
                if q8 is None:
                    kept += 1
                    continue
                new = QLinear(8, q8[0].view(torch.uint8), q8[1], None, bias, child.in_features, child.out_features,
                              cache_dir, isa)
            setattr(module, name, new)
            swapped += 1
    log.info("exact compressed kernels (%s): %d linear layers swapped, %d kept", isa, swapped, kept)
    return swapped, kept
