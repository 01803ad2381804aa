"""The in-process Python API: a target model (engine/target.py) and the engine that decodes for it.

    decoder = Decoder(DecoderConfig())
    result = decoder.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=32)

`generate`/`stream` run through `engine` (engine/engine.py:BatchEngine, the only decode loop), as a
worker's requests do. By default that engine takes one request at a time (others queue, FIFO) and
verifies every TR step's whole tree (`EngineConfig(max_batch=1, batch_aware=False)`); pass an
`engine_config` (and a `cost` model, engine/tuning/cost.py) for batching and per-step tree budgets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from ..core.errors import InvalidArgument
from .config import DecoderConfig
from .engine import BatchEngine
from .model.loader import LoadedModel
from .request.request import GenerationRequest, PreparedRequest
from .results import GenerationResult, StepChunk
from .scheduler import EngineConfig
from .target import TargetModel
from .tr.matrix import AdjacencyMatrix
from .tr.source import DraftSource
from .tuning.cost import CostFn
from .tuning.online import OnlineTuner
from .tuning.records import AcceptanceLog

ONE_AT_A_TIME = EngineConfig(max_batch=1, batch_aware=False)


class Decoder(TargetModel):
    """A target model with its own engine: `generate` decodes to the end, `stream` per step."""

    def __init__(self, config: DecoderConfig, loaded: LoadedModel | None = None, *,
                 engine_config: EngineConfig = ONE_AT_A_TIME, cost: CostFn | None = None) -> None:
        super().__init__(config, loaded)
        self.engine_config, self._cost = engine_config, cost
        self._engine: BatchEngine | None = None
        self._engine_lock = threading.Lock()

    @property
    def engine(self) -> BatchEngine:
        """This decoder's engine (built on first use)."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = BatchEngine(self, self.engine_config, self._cost)
            return self._engine

    def generate(self, request: GenerationRequest | str | None = None, /, *,
                 matrix: AdjacencyMatrix | DraftSource | None = None, cancelled: Callable[[], bool] | None = None,
                 deadline: float | None = None, acceptance: AcceptanceLog | None = None,
                 tuner: OnlineTuner | None = None, **fields) -> GenerationResult:
        """Decode to the end. `request` is a GenerationRequest, or built from `fields` (its field
        names; a positional str is the raw `prompt`). See `stream` for the rest."""
        if not isinstance(request, GenerationRequest):
            request = GenerationRequest(prompt=request, **fields) if request is not None else GenerationRequest(**fields)
        elif fields:
            raise InvalidArgument(f"give a GenerationRequest or its fields, not both (got {sorted(fields)})")
        return self.engine.generate(self.prepare(request), matrix=matrix, cancelled=cancelled, deadline=deadline,
                                    acceptance=acceptance, tuner=tuner)

    def stream(self, request: GenerationRequest | PreparedRequest, *,
               matrix: AdjacencyMatrix | DraftSource | None = None, cancelled: Callable[[], bool] | None = None,
               deadline: float | None = None, acceptance: AcceptanceLog | None = None,
               tuner: OnlineTuner | None = None) -> Iterator[StepChunk | GenerationResult]:
        """Yield a StepChunk per decoding step, then the GenerationResult.

        `request` as from `prepare` (a GenerationRequest is prepared here). `matrix` is the hot-start
        state (an AdjacencyMatrix carried across calls, or a DraftSource such as the matrix
        service); None = a fresh zero matrix. `cancelled` is polled each step; `deadline` is a
        time.monotonic() instant after which decoding stops with finish_reason "time_limit".
        `acceptance` collects one record per TR step (it must belong to the tree used) for the tree
        optimiser. `tuner` = an online tree tuner of the caller's (e.g. one per tenant,
        `new_tuner()`) for a request that names no tree; default: this model's own when its tree
        is "adaptive".
        """
        prepared = request if isinstance(request, PreparedRequest) else self.prepare(request)
        yield from self.engine.stream(prepared, matrix=matrix, cancelled=cancelled, deadline=deadline,
                                      acceptance=acceptance, tuner=tuner)
