"""What a gang's member and its ranks need of the worker's job runner, and nothing more.

The job runner (worker/runtime/job_runner.JobRunner) owns a worker's deliveries and builds its
`GangMember` with itself as the runner; the member runs a rank's task in the runner's process,
state and device, and rank 0's through the runner's own claim and handler path. It needs these
members of the runner, and names them here so that the gang side depends on this protocol, never
on the runner's module (which imports the gang's: that was a cycle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from core.config import Settings
from core.datasets import DatasetCatalog
from core.jobs import JobStore
from core.storage import CheckpointPaths
from worker.device.health import DeviceHealth
from worker.device.pinning import WorkerDevice
from worker.runtime.job_context import JobHandler
from worker.runtime.state import WorkerState


@runtime_checkable
class Runner(Protocol):
    """The job runner as the gang side sees it."""

    @property
    def settings(self) -> Settings: ...  # the lease TTL, the gang timeout, the rendezvous address and port
    @property
    def device(self) -> WorkerDevice: ...  # this worker's device: a rank's device, and its name in the gang
    @property
    def store(self) -> JobStore: ...  # the job store, for reading (rank 0 writes through its delivery)
    @property
    def catalog(self) -> DatasetCatalog: ...  # where a rank finds its job's dataset
    @property
    def paths(self) -> CheckpointPaths: ...  # where a rank finds the job's files (its resume state)
    @property
    def state(self) -> WorkerState: ...  # the job in hand and the flags that stop it (shutdown, out of service)
    @property
    def health(self) -> DeviceHealth: ...  # whether a rank's failure broke the device
    @property
    def torch_threads(self) -> int: ...  # the torch threads a job's own thread runs on
    @property
    def release_cores(self) -> Callable[[], None]: ...  # the /predict forward off the job's cores
    @property
    def take_out_of_service(self) -> Callable[[str], None]: ...  # a broken device: stop serving, exit
    def run_delivery(self, job_id: str, token: str, handler: JobHandler | None = None) -> None:
        """Claim the delivery and run `handler` in the runner's lifecycle (rank 0's way to the job)."""
        ...
