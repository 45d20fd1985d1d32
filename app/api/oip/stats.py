"""GET /v2/models/{name}/stats: what this API process served, per model and version.

Triton's statistics extension, as the tools that read it need: perf_analyzer reads the counts
before and after each measurement window and aborts unless the three compute counts agree, and
without a version asked it takes the version whose queue count moved. So every successful request
counts once in success, queue and each compute stage, with the times the API can see: `queue` is
the wait from the request being queued on a device's list to its answer (the worker's queueing,
batching and forward together: torchyard does not report them apart per request), `compute_input`
the reading and checking of the body, `compute_output` the encoding of the answer, and
`compute_infer` zero (it is inside `queue`). A failed request counts in `fail` only.

The counters are this process's (with TORCHYARD_API_WORKERS > 1, each process answers its own
share; /metrics has the cluster's request counts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.api.oip.protocol import Duration, InferStats, ModelStats

MAX_TRACKED = 4096  # (name, version) pairs kept; the oldest is dropped past it


@dataclass
class _Counters:
    success: list[int] = field(default_factory=lambda: [0, 0])
    fail: list[int] = field(default_factory=lambda: [0, 0])
    queue_ns: int = 0
    input_ns: int = 0
    output_ns: int = 0
    inferences: int = 0
    last_ms: int = 0


class InferenceStats:
    def __init__(self) -> None:
        self._by_model: dict[tuple[str, str], _Counters] = {}

    def _counters(self, name: str, version: str) -> _Counters:
        counters = self._by_model.get((name, version))
        if counters is None:
            if len(self._by_model) >= MAX_TRACKED:
                self._by_model.pop(next(iter(self._by_model)))
            counters = self._by_model[(name, version)] = _Counters()
        return counters

    def succeeded(self, name: str, version: str, items: int, *, input_ns: int, queue_ns: int, output_ns: int) -> None:
        counters = self._counters(name, version)
        counters.success[0] += 1
        counters.success[1] += input_ns + queue_ns + output_ns
        counters.input_ns += input_ns
        counters.queue_ns += queue_ns
        counters.output_ns += output_ns
        counters.inferences += items
        counters.last_ms = time.time_ns() // 1_000_000

    def failed(self, name: str, version: str, took_ns: int) -> None:
        counters = self._counters(name, version)
        counters.fail[0] += 1
        counters.fail[1] += took_ns

    def of(self, name: str, versions: list[str]) -> list[ModelStats]:
        """Every version of `name` asked for, served or not (zeros), in order."""
        return [self._document(name, version, self._by_model.get((name, version)) or _Counters())
                for version in versions]

    def every(self) -> list[ModelStats]:
        """Every (model, version) this process served or failed, oldest first."""
        return [self._document(name, version, counters) for (name, version), counters in self._by_model.items()]

    @staticmethod
    def _document(name: str, version: str, counters: _Counters) -> ModelStats:
        count = counters.success[0]
        return ModelStats(
            name=name, version=version, last_inference=counters.last_ms, inference_count=counters.inferences,
            execution_count=count,
            inference_stats=InferStats(
                success=Duration(count=count, ns=counters.success[1]),
                fail=Duration(count=counters.fail[0], ns=counters.fail[1]),
                queue=Duration(count=count, ns=counters.queue_ns),
                compute_input=Duration(count=count, ns=counters.input_ns),
                compute_infer=Duration(count=count, ns=0),
                compute_output=Duration(count=count, ns=counters.output_ns),
                cache_hit=Duration(), cache_miss=Duration()))
