"""The kernels' C library: which ISA variant this CPU runs (/proc/cpuinfo), the gcc build of
csrc/*.c into one shared library per variant, its on-disk cache (one file per source version), and
loading it with ctypes."""

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

from ..choices import ARITHMETICS
from .pack import PANEL, Q4_LAYOUTS

log = logging.getLogger("trserve.engine")

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_libs: dict[str, ctypes.CDLL] = {}  # isa -> the loaded library

# Kernel variants, best first: the /proc/cpuinfo flags each needs, and its compile flags. The flags
# are explicit ISA subsets over baseline x86-64 (never -march=native, nor the compiler's default
# -march, which some distributions raise), so a library built on one host runs on any other host
# with those flags, e.g. one built into an image. -ffp-contract=off: the compiler must not fuse or
# split multiply-adds by itself; csrc/qlinear.c writes out every one, the same in all variants.
# The *vnni variants differ from their base only in the int8 arithmetic's integer dot products (one
# vpdpbusd where the base takes vpmaddubsw + vpmaddwd): the same bits in both arithmetics.
_AVX512 = (frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma", "f16c"}),
           ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-mf16c"))
_AVX2 = (frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c"))
_ISAS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx512vnni": (_AVX512[0] | {"avx512_vnni"}, (*_AVX512[1], "-mavx512vnni")),
    "avx512": _AVX512,
    "avx2vnni": (_AVX2[0] | {"avx_vnni"}, (*_AVX2[1], "-mavxvnni")),
    "avx2": _AVX2,
    "scalar": (frozenset(), ()),
}
ISAS = tuple(_ISAS)
_BASE_CFLAGS = ("-O3", "-march=x86-64", "-mtune=generic", "-ffp-contract=off", "-pthread", "-shared", "-fPIC")


# ---- which variant this host runs ----------------------------------------------------------------
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
    """The variant `isa` resolves to here: one of ISAS ("auto": the best this CPU runs). ValueError for an unknown name, RuntimeError where this host cannot run it."""
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


# ---- the build and its cache ---------------------------------------------------------------------
def _compiler() -> str | None:
    from shutil import which

    return os.environ.get("CC") or which("gcc") or which("cc")


def _cflags(isa: str, defines: tuple[str, ...] = ()) -> list[str]:
    return [*_BASE_CFLAGS, *_ISAS[isa][1], *(f"-D{d}" for d in defines)]


def _sources() -> list[Path]:
    """Every source file of the library, headers included (the build key hashes them all, so any
    edit rebuilds). Its .c files are the compilation units: linear kernels, native forward, pool."""
    return sorted(p for p in _CSRC.iterdir() if p.suffix in (".c", ".h"))


def kernel_build_key(isa: str, defines: tuple[str, ...] = ()) -> str:
    """16 hex digits naming one build of the kernel sources for `isa` (a resolved variant): it changes
    with any source file (name or text) and the flags, so caches of measured speeds (calibrations)
    follow the kernels."""
    h = hashlib.sha256()
    for p in _sources():
        text = p.read_bytes()
        h.update(f"{p.name}\0{len(text)}\0".encode() + text)
    h.update(" ".join(_cflags(isa, defines)).encode())
    return h.hexdigest()[:16]


def build_kernels(cache_dir: Path | None = None, isa: str = "auto", defines: tuple[str, ...] = ()) -> Path:
    """Compile csrc/*.c into one library for `isa` ("auto": this CPU's best) once per source version
    into `cache_dir`/kernels; returns the library. Any variant builds on any x86-64 host (an image can
    hold all three); running it needs the CPU flags. `defines`: macros of a profiling build (its own
    key and file; the served library never has them)."""
    from ..paths import default_cache_dir

    _check_isa(isa)
    isa = kernel_isa() if isa == "auto" else isa
    key = kernel_build_key(isa, defines)
    out = Path(cache_dir or default_cache_dir()) / "kernels" / f"qlinear-{isa}-{key}.so"
    if not out.exists():
        if _compiler() is None:
            raise RuntimeError("no C compiler (gcc) to build the compressed kernels")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        units = [p for p in _sources() if p.suffix == ".c"]
        log.warning("building the compressed kernels for %s (once per source version; ~20-40 s on 2 cores)", isa)
        t0 = time.perf_counter()
        res = _compile_and_link(isa, units, tmp, defines)
        if res.returncode != 0:
            os.unlink(tmp)
            names = ", ".join(p.name for p in units)
            raise RuntimeError(f"compiling {names} for {isa} failed: {res.stderr.strip()[:500]}")
        log.info("built %s in %.1f s", out.name, time.perf_counter() - t0)
        os.chmod(tmp, 0o755)  # mkstemp makes it private; other users (a container's) must load it
        os.replace(tmp, out)  # atomic: concurrent loaders see a whole library or none
    return out


def _compile_and_link(isa: str, units: list[Path], out: str, defines: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Each unit compiled on its own, as many at once as there are cores (the same object code as one
    driver call compiling them in turn: the same flags per unit), then linked into `out`; the first
    failure's result, else the link's."""
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory(dir=Path(out).parent) as tmp:
        objs = [str(Path(tmp) / f"{i}-{u.stem}.o") for i, u in enumerate(units)]
        cmds = [[_compiler(), *_cflags(isa, defines), "-c", "-o", o, str(u)] for o, u in zip(objs, units)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(cmds), os.cpu_count() or 1))) as pool:
            results = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), cmds))
        failed = next((r for r in results if r.returncode != 0), None)
        if failed is not None:
            return failed
        return subprocess.run([_compiler(), *_cflags(isa, defines), "-o", out, *objs, "-lm"], capture_output=True,
                              text=True)


# ---- loading -------------------------------------------------------------------------------------
def _library(cache_dir: Path, isa: str, arithmetic: str = "exact"):
    """The linear entry point of variant `isa` (already resolved and runnable here) in `arithmetic`,
    its library loaded once."""
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"arithmetic must be one of {', '.join(ARITHMETICS)}; got {arithmetic!r}")
    if isa not in _libs:
        _load(cache_dir, isa)
    return _libs[isa].trserve_qlinear if arithmetic == "exact" else _libs[isa].trserve_qlinear_i8_kept


def _load(cache_dir: Path, isa: str) -> None:
    lib = ctypes.CDLL(str(build_kernels(cache_dir, isa)))
    lib.trserve_qlinear_isa.restype = ctypes.c_char_p
    built = lib.trserve_qlinear_isa().decode()
    if built != isa:  # the source picks its code path from the compile flags
        raise RuntimeError(f"kernel library built for {isa} reports {built}")
    if lib.trserve_qlinear_panel() != PANEL:  # QLinear packs outputs in panels of this size
        raise RuntimeError(f"kernel library panels are not {PANEL} outputs")
    if lib.trserve_qlinear_q4_layout() not in range(len(Q4_LAYOUTS)):
        raise RuntimeError("kernel library reads an unknown q4 code layout")
    P, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.trserve_qlinear, lib.trserve_qlinear_i8):
        fn.restype = ctypes.c_int  # 0, or -1 when the kernel could not allocate its buffers
        fn.argtypes = [ctypes.c_int, P, i64, i64, i64, P, P, P, P, P, ctypes.c_int]
    lib.trserve_qlinear_i8_kept.restype = ctypes.c_int  # 0, -1 without memory, -2 too many kept inputs
    lib.trserve_qlinear_i8_kept.argtypes = [ctypes.c_int, P, i64, i64, i64, P, P, P, P, P, i64, P, P, ctypes.c_int]
    lib.trserve_quantize_rows.restype = ctypes.c_int
    lib.trserve_quantize_rows.argtypes = [P, i64, i64, P, P, P, P]
    _forward_argtypes(lib.trserve_forward)
    lib.trserve_forward_check.restype = ctypes.c_int
    lib.trserve_forward_check.argtypes = [P]
    lib.trserve_to_half.restype = ctypes.c_int  # tests: the float16 rounding of the int8 KV buffers
    lib.trserve_to_half.argtypes = [P, i64, P]
    lib.trserve_gated.restype = ctypes.c_int  # tests: the MLP's activation (SiLU, GELU's tanh form) alone
    lib.trserve_gated.argtypes = [i64, P, P, i64, P]
    lib.trserve_top_probs.restype = ctypes.c_int
    lib.trserve_top_probs.argtypes = [P, i64, i64, i64, P, P]
    _libs[isa] = lib


def _forward_argtypes(f) -> None:
    P, i64 = ctypes.c_void_p, ctypes.c_int64
    f.restype = ctypes.c_int
    f.argtypes = [P, i64, P, P, P, P, P, P, P, P, P, i64, P, i64, P, i64, P, P, ctypes.c_int]


PHASES = ("qkv", "rope", "attention", "o", "gate_up", "down", "head", "topk")  # csrc/forward.c, in order


@functools.lru_cache(maxsize=None)
def phases_library(isa: str):
    """The profiling build of variant `isa` (-DTR_PHASES, built once into the default cache): its
    trserve_forward (the served one's arithmetic and arguments, timing each phase) and
    trserve_forward_phases (seconds per phase of PHASES, then the whole call; read and reset)."""
    lib = ctypes.CDLL(str(build_kernels(None, isa, defines=("TR_PHASES",))))
    _forward_argtypes(lib.trserve_forward)
    lib.trserve_forward_phases.restype = ctypes.c_int64
    lib.trserve_forward_phases.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    return lib.trserve_forward, lib.trserve_forward_phases


def q4_layout(cache_dir: Path, isa: str) -> str:
    """The q4 code layout ("bytes" or "lanes", csrc/qlinear.c) the `isa` library reads."""
    _library(cache_dir, isa)
    return Q4_LAYOUTS[_libs[isa].trserve_qlinear_q4_layout()]


def quantize_library(isa: str):
    """trserve_quantize_rows of variant `isa` (csrc/qlinear_i8.c): the int8 arithmetic's activations."""
    if isa not in _libs:
        raise RuntimeError(f"the {isa} kernel library is not loaded (no QLinear built on it)")
    return _libs[isa].trserve_quantize_rows


def top_probs_library(isa: str):
    """trserve_top_probs of variant `isa` (csrc/forward.c): softmax probabilities of chosen ids."""
    if isa not in _libs:
        raise RuntimeError(f"the {isa} kernel library is not loaded (no QLinear built on it)")
    return _libs[isa].trserve_top_probs


def forward_library(isa: str):
    """trserve_forward of variant `isa` (csrc/forward.c), from the library its QLinear layers loaded."""
    if isa not in _libs:
        raise RuntimeError(f"the {isa} kernel library is not loaded (no QLinear built on it)")
    return _libs[isa].trserve_forward


def forward_check_library(isa: str):
    """trserve_forward_check of variant `isa`: 0 where the native forward takes a model struct."""
    forward_library(isa)
    return _libs[isa].trserve_forward_check
