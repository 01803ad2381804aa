"""The forward cost model the engine sizes trees by, chosen in one place: the adaptive tuner's
calibration, else this model and machine's cached calibration (`trserve tune`, or measured now
when asked), else a proxy curve for the device kind. Seconds of one forward of `width` tokens at KV
length `kv`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("trserve.engine")
CostFn = Callable[[int, int], float]


def proxy_cost(width: int, kv: int) -> float:
    """A forward's cost on a CPU when no calibration is at hand (the AVX-512 calibration's shape:
    1 token 16 ms, 4 tokens 20 ms, 16 tokens 42 ms, plus attention over the context)."""
    return 0.0145 + 0.0017 * width + 2e-6 * kv * width


def gpu_proxy_cost(width: int, kv: int) -> float:
    """The same on a GPU: a small model's graphed forward is bound by its launches and weight reads
    far beyond the widths a batch reaches (a guess of the shape, not a measurement: no GPU has been
    at hand; the loop's online correction scales it, and `trserve tune` measures the real one)."""
    return 0.004 + 2e-6 * width + 2e-9 * kv * width


def device_proxy(device_type: str) -> CostFn:
    return gpu_proxy_cost if device_type == "cuda" else proxy_cost


def engine_cost(target, *, measure: bool = False) -> CostFn:
    """The cost curve for an engine over `target` (engine/target.py:TargetModel). `measure`: calibrate
    now (~1 min, cached) when no calibration is cached (benchmarks); else fall back to the proxy."""
    from ..model.paths import default_cache_dir
    from .calibrate import cached_cost_model, load_or_measure

    if target.autotuner is not None:
        return target.autotuner.cost.cost
    cache = Path(target.config.cache_dir) if target.config.cache_dir else default_cache_dir()
    model = load_or_measure(target.loaded, cache) if measure else cached_cost_model(target.loaded, cache)
    if model is not None:
        return model.cost
    loaded = target.loaded
    if target.device.type == "cpu" and not loaded.native:
        log.warning("this model runs a fallback forward (%s kernels, transformers' modules) whose costs are not "
                    "measured: trees are drafted only once `trserve tune` has measured it on this machine (until "
                    "then every step is plain decoding, never slower than it)", loaded.kernels)
        return unmeasured_cost
    log.info("no calibration of this model and device is cached: batch tree budgets use a default cost "
             "curve (run `trserve tune` once to measure this machine)")
    return device_proxy(target.device.type)


def unmeasured_cost(width: int, kv: int) -> float:
    """A path whose costs are unknown priced as if every row cost a whole forward: no tree can promise
    more tokens per second than plain decoding under it, so the budget drafts nothing (issue 55, item
    5: TR never loses on a path it cannot price)."""
    return width * proxy_cost(1, kv)
