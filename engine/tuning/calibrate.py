"""Calibration: what one verification forward of width w costs on this device, at KV length s.

The tree optimiser trades accepted tokens against forward cost, and the cost curve is a property
of (model, device, threads, kernels): on a 2-core CPU a 32-token forward costs ~2x a one-token
forward, on a GPU it is nearly flat. Measured once and cached as JSON under
~/.cache/trserve/calibration/ (`trserve tune --recalibrate` measures again).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ...core.progress import Progress

log = logging.getLogger("trserve.engine")

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # 3, 6: trees at batch 1 live there
KV_LENS = (128, 512, 1024)


@dataclass(frozen=True)
class CostModel:
    """seconds[i][j] = fastest forward time at kv_lens[i] cached tokens and widths[j] new tokens."""

    key: str
    widths: tuple[int, ...]
    kv_lens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if len(self.seconds) != len(self.kv_lens) or any(len(r) != len(self.widths) for r in self.seconds):
            raise ValueError("seconds must be a kv_lens x widths table")
        if list(self.widths) != sorted(self.widths) or list(self.kv_lens) != sorted(self.kv_lens):
            raise ValueError("widths and kv_lens must be ascending")

    def costs(self, width: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """Seconds per forward, bilinear in (width, kv); both [N] (kv broadcasts), clamped to the table."""
        width = np.atleast_1d(np.asarray(width, dtype=float))  # [N]
        kv = np.broadcast_to(np.clip(np.asarray(kv, dtype=float), self.kv_lens[0], self.kv_lens[-1]), width.shape)
        per_kv = np.stack([np.interp(width, self.widths, row) for row in self.seconds])  # [K, N]
        if len(self.kv_lens) == 1:
            return per_kv[0]
        lens = np.asarray(self.kv_lens, dtype=float)
        i = np.clip(np.searchsorted(lens, kv, side="right") - 1, 0, len(lens) - 2)  # [N]
        cols = np.arange(width.shape[0])
        frac = (kv - lens[i]) / (lens[i + 1] - lens[i])
        return per_kv[i, cols] + frac * (per_kv[i + 1, cols] - per_kv[i, cols])

    def cost(self, width: int, kv: int) -> float:
        return float(self.costs(np.array([width]), np.array([kv]))[0])

    def table(self) -> str:
        head = "kv \\ width " + " ".join(f"{w:>6}" for w in self.widths)
        rows = [f"{kv:>10} " + " ".join(f"{1000 * s:6.1f}" for s in r) for kv, r in zip(self.kv_lens, self.seconds)]
        return "\n".join([head, *rows]) + "\n(ms per verification forward)"


def measure(model, widths=WIDTHS, kv_lens=KV_LENS, reps: int = 2, passes: int = 4, key: str = "",
            native: bool | None = None) -> CostModel:
    """Time forwards of `w` new tokens over `s` cached ones (random ids; cost does not depend on them)
    through the model runner the decoders use (`native`: as ModelRunner takes it).

    Each cell keeps its fastest time over `passes` sweeps of the whole grid with `reps` runs each:
    other load only ever adds time, and sweeping the grid repeatedly spreads slow spells (shared
    or throttled cores) over all cells instead of skewing a few.
    """
    from ..model.runner import ModelRunner, quiet_torch_threads, uses_kernel_pool

    device = model.device
    dtype = next(model.parameters()).dtype
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    best = np.full((len(kv_lens), len(widths)), np.inf)
    with torch.inference_mode(), quiet_torch_threads(uses_kernel_pool(model)):  # as the decode loops run
        runner = ModelRunner(model, len(kv_lens), dtype, native=native)
        for kv in kv_lens:  # row i holds kv_lens[i] cached tokens
            row = runner.kv.open_row()
            runner.prefill(row, torch.randint(0, vocab, (kv,), generator=g).to(device),
                           torch.tensor([kv - 1], device=device))
            runner.kv.activate(row)
        cells = passes * len(kv_lens) * len(widths)
        with Progress("calibrating", total=cells, unit="timings", logger=log) as progress:
            for _ in range(passes):
                for i, kv in enumerate(kv_lens):
                    for j, w in enumerate(widths):
                        best[i, j] = min(best[i, j], _time_forward(runner, i, w, reps, vocab, g))
                        progress.step(note=f"kv {kv}, width {w}")
    # A wider forward never costs less; enforcing that removes what noise is left.
    table = tuple(tuple(float(x) for x in np.maximum.accumulate(row)) for row in best)
    for kv, row in zip(kv_lens, table):
        log.info("calibrated kv=%d: %s", kv, " ".join(f"{w}:{1000 * s:.1f}ms" for w, s in zip(widths, row)))
    return CostModel(key=key, widths=tuple(widths), kv_lens=tuple(kv_lens), seconds=table)


def _time_forward(runner, row: int, w: int, reps: int, vocab: int, g) -> float:
    """Fastest of `reps` timed forwards (after one untimed) of w tokens on KV row `row` alone (the
    other rows stay as they are: a single-row step of the runner, as one sequence decodes)."""
    from ..model.runner import RowInput

    device = runner.device
    ids = torch.randint(0, vocab, (w,), generator=g).to(device)
    one = RowInput(ids, torch.arange(w, device=device), torch.zeros(w, w, dtype=runner.dtype, device=device))
    times = []
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        runner.single_step(row, one)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibration_key(fingerprint: str, device: torch.device, kernels: str, attention: str = "sdpa") -> str:
    return f"{fingerprint}-{device.type}-{torch.get_num_threads()}t-{kernels}-{attention}-torch{torch.__version__}"


def cost_model_path(loaded, cache_dir: Path) -> Path:
    attention = getattr(loaded.model.config, "_attn_implementation", None) or "eager"
    isa = getattr(loaded, "isa", None)  # the compressed kernels' speed depends on their ISA variant
    if isa:  # a build of other kernel sources has other speeds: its key names the calibration too
        from ..model.kernels.build import kernel_build_key

        kernels = f"{loaded.kernels}-{isa}-{getattr(loaded, 'arithmetic', 'exact')}-{kernel_build_key(isa)[:8]}"
    else:
        kernels = loaded.kernels
    kernels += f"-{getattr(loaded, 'forward', 'transformers')}"  # the native forward costs far less per step
    key = calibration_key(loaded.fingerprint, loaded.device, kernels, attention)
    return Path(cache_dir) / "calibration" / f"{key.replace('/', '_')}.json"


def save_cost_model(model: CostModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(model)))
    tmp.replace(path)


def cached_cost_model(loaded, cache_dir: Path) -> CostModel | None:
    """The cached cost model for this (model, device, threads, kernels), or None (not measured yet)."""
    path = cost_model_path(loaded, cache_dir)
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        return CostModel(key=doc["key"], widths=tuple(doc["widths"]), kv_lens=tuple(doc["kv_lens"]),
                         seconds=tuple(tuple(r) for r in doc["seconds"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable calibration %s (%s)", path, e)
        return None


def load_or_measure(loaded, cache_dir: Path, force: bool = False, reps: int = 2) -> CostModel:
    """The cached cost model for this (model, device, threads, kernels), measuring it when missing."""
    path = cost_model_path(loaded, cache_dir)
    cached = None if force else cached_cost_model(loaded, cache_dir)
    if cached is not None and tuple(cached.widths) == WIDTHS and tuple(cached.kv_lens) == KV_LENS:
        return cached  # (one measured on other widths predates them: measured again)
    log.info("calibrating the forward cost per tree width (once per model, device, threads; ~1 min)")
    model = measure(loaded.model, reps=reps, key=path.stem, native=getattr(loaded, "native", None))
    save_cost_model(model, path)
    return model
