"""The one settings object. Every process reads it once and passes it down."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_api_workers() -> int:
    """API processes when TORCHYARD_API_WORKERS is unset: half this process's cores, at least 1, at
    most 4. One uvicorn process serves far fewer /predict requests than a GPU classifies (its CPU
    per request: docs/benchmarks.md, "Settings' defaults"), so a GPU host needs several; but the
    cores are shared with what the API feeds: each worker's decoding and device feeder, Redis
    (every /predict crosses it twice), and the training jobs' data loading, hence half. 1 on a
    2-core machine, where `up` runs Redis and a worker too. 4 at most: past what four processes
    serve, the single Redis and the workers' decoding are the limit, so more processes only add
    memory (an API process imports no torch, so a small share) and idle connections; raise it
    after measuring (docs/operations.md)."""
    try:
        cores = len(os.sched_getaffinity(0))  # the CPUs this process may use (a container's cpuset)
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return min(4, max(1, cores // 2))


# A GPU's or a MIG instance's UUID as `nvidia-smi -L` prints it and CUDA_VISIBLE_DEVICES takes it
# (a unique prefix too). The older MIG form, MIG-GPU-<uuid>/<gi>/<ci>, does not match: its slashes
# cannot name a device id.
_GPU_UUID = re.compile(r"(GPU|MIG)-[0-9A-Fa-f][0-9A-Fa-f-]*")


def gpu_selector(value: str) -> str | None:
    """`value` as a GPU selector other than an index (a GPU-… or MIG-… UUID), or None if it is not one."""
    value = value.strip()
    return value if _GPU_UUID.fullmatch(value) else None


class Settings(BaseSettings):
    """torchyard settings, from the environment (prefix ``TORCHYARD_``) or a ``.env`` file."""

    # validate_by_name: a field with an env alias (predict_decode_processes) is still set by its name
    # in code, Settings(predict_decode_processes=2), instead of that being dropped as an extra.
    model_config = SettingsConfigDict(env_prefix="TORCHYARD_", env_file=".env", extra="ignore", env_ignore_empty=True,
                                      validate_by_name=True)

    # --- where things live -------------------------------------------------------------
    redis_url: str | None = Field(
        default=None,
        description="Broker, job store and result backend. Unset: the embedded Redis under data_dir.",
    )
    data_dir: Path = Field(default=Path("./var"), description="Datasets, checkpoints, embedded Redis files.")

    # --- API ---------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: SecretStr | None = Field(default=None, description="When set, a bearer token every endpoint but /healthz needs.")
    access_log: bool = Field(default=False, description="uvicorn's line per request; a share of the API's CPU on /predict (docs/benchmarks.md).")
    api_workers: int = Field(
        default_factory=default_api_workers, ge=1,
        description="API processes serving one port (uvicorn's supervisor). Unset: half the cores, 1 to 4.",
    )

    # --- workers and devices -----------------------------------------------------------
    node_name: str = Field(default_factory=socket.gethostname, description="Host part of device ids and worker names.")
    devices: str = Field(default="auto", description="`torchyard up`: 'auto', 'cpu', or GPUs by index ('0,1') "
                                                     "or GPU-/MIG- UUID.")
    host_gpu_index: int | None = Field(
        default=None,
        description="The host's index of this worker's GPU when a container runtime renumbered it to 0.",
    )
    heartbeat_interval_s: float = Field(default=1.0, gt=0, le=2.0)
    heartbeat_ttl_s: float = Field(default=6.0, gt=0)
    lease_ttl_s: float = Field(default=20.0, gt=0, description="A running job whose worker stops renewing is redelivered after this.")
    max_attempts: int = Field(default=3, ge=1, description="Deliveries of a job before it fails for good.")

    # --- training ------------------------------------------------------------------------
    allow_download: bool = Field(default=False, description="Let torchvision download built-in datasets.")
    verify_builtin_checksums: bool = Field(
        default=True,
        description="Check cifar10's files against torchvision's md5 sums. Off only for re-packed or test copies.",
    )
    decode_lock_wait_s: float = Field(
        default=3600.0, gt=0,
        description="How long a job waits for another worker that is decoding the same uploaded set at the same "
                    "input size (it holds the set's lock) before the job fails saying so; cancelling the job ends "
                    "the wait at once.",
    )

    # --- inference -----------------------------------------------------------------------
    predict_timeout_s: float = Field(default=30.0, gt=0)
    predict_max_batch: int = Field(default=32, ge=1)
    # How long a batch may wait for the company recent traffic promises (worker/serving/batching.BatchWindow);
    # a lone request on a quiet device never waits (docs/benchmarks.md has how 10 ms was chosen).
    predict_max_wait_ms: float = Field(default=10.0, ge=0)
    # Named for threads until decoding moved to processes; the old name is still read, so existing
    # deployments keep their setting. An alias bypasses env_prefix, so both names carry it.
    # pydantic-settings takes the first name of AliasChoices that a source holds: the new one wins
    # when both are set in the same source (between sources the usual order holds: the environment
    # over .env, whichever name each uses).
    predict_decode_processes: int | None = Field(
        default=None, ge=1,
        validation_alias=AliasChoices("TORCHYARD_PREDICT_DECODE_PROCESSES", "TORCHYARD_PREDICT_DECODE_THREADS"),
        description="processes that decode /predict images, off the device thread. Unset: the cores this "
                    "worker may use. TORCHYARD_PREDICT_DECODE_THREADS, its former name, is still read; "
                    "the new name wins when both are set.")
    predict_decode_timeout_s: float = Field(
        default=10.0, gt=0,
        description="How long a batch's images may take in the decoding processes once the batch is awaited: "
                    "a process that has not finished its share by then is taken as stuck, killed, its pool "
                    "replaced, and its images decoded again one at a time (an image that takes as long alone "
                    "is refused with 415). It bounds how long one stuck decoder holds the device's /predict.")
    decode: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="Where a CUDA worker decodes /predict's JPEGs: `cuda` with nvJPEG on its GPU, batched, resized "
                    "there (worker/data/device_jpeg.py; what nvJPEG is not given or refuses decodes on the "
                    "CPU, per image), `cpu` in its decoding processes. `auto`: the GPU on a CUDA worker, until a "
                    "GPU measurement says otherwise (docs/gpu.md). A CPU worker always decodes on its CPU.")
    decode_batch_pixels: int = Field(
        default=48_000_000, ge=1,
        description="Most decoded pixels one nvJPEG call holds on the device (`decode=cuda`): a batch's JPEGs "
                    "are split into calls under it by their headers, so device memory for decoding stays "
                    "bounded (about 3 bytes a pixel for the output, plus nvJPEG's buffers).")
    model_cache_count: int = Field(default=8, ge=1)
    model_cache_bytes: int = Field(default=2 * 1024**3, ge=1)
    predict_cpu_threads: int | None = Field(
        default=None, ge=1,
        description="torch threads of a CPU worker's /predict forward while no job runs on it, for every "
                    "model; while one does, one thread, so the job has the cores (worker/device/cpu_threads.py). Unset: "
                    "all the cores for a model whose one-image forward takes 4 ms or more on one thread "
                    "(resnet18), one for a lighter one (cifar_net), whose forward cannot repay a team's spin.")

    # --- limits on input -------------------------------------------------------------------
    max_image_bytes: int = Field(default=10 * 1024**2, ge=1)
    max_image_pixels: int = Field(default=40_000_000, ge=1)
    max_images_per_request: int = Field(default=64, ge=1)
    # Below Redis's largest value (proto-max-bulk-len, 512 MB): a request travels to a worker as one.
    max_predict_request_bytes: int = Field(
        default=128 * 1024**2, ge=1024, le=448 * 1024**2,
        description="Largest /predict body (its images and their framing): refused with 413 as it streams in.")
    predict_memory_budget_bytes: int = Field(
        default=512 * 1024**2, ge=1024,
        description="Bytes of /predict bodies one API process holds at once (received and waiting for their "
                    "answer), counted as they arrive; a request that would go past it is refused with 503 and "
                    "Retry-After. At least TORCHYARD_MAX_PREDICT_REQUEST_BYTES.")
    predict_memory_per_client_bytes: int | None = Field(
        default=None, ge=0,
        description="Bytes of that budget the requests of one client address may hold (503 and Retry-After past "
                    "it). Unset: the budget less one largest request, and at least one, so one address cannot "
                    "keep another's request out; 0: no cap per address (behind a proxy that forwards none).")
    max_upload_bytes: int = Field(default=1024**3, ge=1)
    max_zip_entries: int = Field(default=200_000, ge=1)
    max_zip_uncompressed_bytes: int = Field(default=4 * 1024**3, ge=1)
    max_zip_ratio: float = Field(default=200.0, gt=1)
    max_request_bytes: int | None = Field(
        default=None, ge=1,
        description="Largest request body (Content-Length or streamed). Unset: max_upload_bytes + 1 MiB.",
    )
    max_json_bytes: int = Field(default=1024**2, ge=1, description="Largest application/json request body.")

    # --- aliases and exports ---------------------------------------------------------------
    alias_warm_timeout_s: float = Field(
        default=30.0, gt=0, le=600,
        description="How long a move waits for the new target to load where the old one is resident.",
    )
    export_retry_after_s: int = Field(
        default=2, ge=1, le=60, description="Retry-After of a 202 from GET /jobs/{id}/export while it builds.",
    )

    # --- reliability: dispatch reconciliation, device faults ---------------------------------
    dispatch_grace_s: float | None = Field(
        default=None, gt=0,
        description="A queued job not claimed this long after its message was sent is looked for; if its "
                    "message is not waiting in its queue it is re-sent. Unset: lease_ttl_s.",
    )
    device_fault_file: Path | None = Field(
        default=None,
        description="Tests and `make chaos` only: when this file appears, the worker's next training step or "
                    "/predict forward raises the CUDA error it holds, as a broken GPU would (the CPU twin of a "
                    "sticky CUDA error).",
    )

    # --- data-parallel jobs: docs/training.md, docs/deployment.md "Ports" ----------------------
    advertise_address: str | None = Field(
        default=None,
        description="The address the other ranks of a gang reach this worker at: its rendezvous store when it "
                    "runs rank 0 (listening there only), and the interface gloo and NCCL use. Unset: what this "
                    "host's name resolves to (`up` with its embedded Redis sets 127.0.0.1).",
    )
    rendezvous_port: int = Field(
        default=29500, ge=1, le=65535,
        description="Rank 0's rendezvous store listens on the first free port from here (up to 64 ports up).",
    )
    gang_timeout_s: float | None = Field(
        default=None, gt=0,
        description="A rank waits this long for the others in a collective before the gang's attempt ends "
                    "(torch.distributed's process-group timeout). Unset: lease_ttl_s.",
    )

    # --- hostile clients and resource exhaustion (docs/security.md) ----------------------------
    allow_unauthenticated: bool = Field(
        default=False,
        description="Serve without TORCHYARD_API_KEY on a non-loopback address. Off: `api` and `up` refuse to start.",
    )
    allowed_hosts: str = Field(
        default="",
        description="Comma-separated Host names served besides localhost (DNS-rebinding guard); '*' serves any.",
    )
    allowed_origins: str = Field(
        default="",
        description="Comma-separated browser origins (https://ui.example) allowed to send state-changing requests.",
    )
    header_timeout_s: float = Field(default=10.0, gt=0, description="A request's headers must arrive within this.")
    body_timeout_s: float = Field(default=30.0, gt=0, description="Time for a request body, plus 1 s per min rate bytes.")
    min_body_rate: int = Field(default=10_000, ge=1, description="Bytes per second a slow body must keep up (after the timeout).")
    max_header_bytes: int = Field(default=64 * 1024, ge=1024, description="Largest request head (line + headers).")
    max_connections: int = Field(default=1024, ge=1, description="Open connections of an API process (more: 503).")
    max_connections_per_client: int = Field(
        default=128, ge=0, description="Open connections from one client address (0: no limit; raise behind a proxy).",
    )
    admission_check: bool = Field(default=True, description="Refuse at submit a job whose memory fits no worker.")
    admission_headroom: float = Field(
        default=0.2, ge=0, lt=1, description="Share of a worker's memory a job may not use (Redis, the OS, models).",
    )
    worker_oom_score_adj: int = Field(
        default=800, ge=0, le=1000, description="Workers are the kernel OOM killer's first choice, never Redis.",
    )
    keep_succeeded_jobs_days: float = Field(default=0, ge=0, description="Succeeded jobs (record, events, files). 0: forever.")
    keep_failed_jobs_days: float = Field(default=30, ge=0, description="Failed and cancelled jobs. 0: forever.")
    keep_job_events_days: float = Field(default=7, ge=0, description="Event streams of finished jobs (trimmed). 0: forever.")
    keep_unused_datasets_days: float = Field(default=0, ge=0, description="Uploads no job used for this long. 0: forever.")
    keep_audit_days: float = Field(default=90, ge=0, description="Audit log entries (GET /audit). 0: until the cap.")
    audit_max_entries: int = Field(default=100_000, ge=100, description="The audit log's cap: the oldest entries "
                                   "go first past it (about 300 bytes each in Redis).")
    cleanup_interval_s: float = Field(default=3600, gt=0, description="How often one API process runs the cleanup.")
    # --- sweeps (core/sweeps/): how often each API process moves the running sweeps on --------------
    sweep_tick_s: float = Field(default=1.0, gt=0, le=60, description="Each API process looks at the running "
                                "sweeps this often (one at a time per sweep, a Redis lock): tells ended trials, "
                                "asks for new ones.")

    # --- the Open Inference Protocol (/v2, app/api/oip/) -------------------------------------
    oip_max_json_bytes: int = Field(
        default=8 * 1024**2, ge=1024,
        description="Largest JSON part of a /v2 infer request (parsed, JSON numbers take up to 8× their text): 413.")

    # --- MLflow tracking and the model registry (docs/training.md "Tracking in MLflow") -----------
    mlflow_tracking_uri: str | None = Field(
        default=None, description="An MLflow tracking server (http://host:5000): every training job becomes a run "
                                  "there, aliases registered models. Unset: nothing is sent. Credentials: MLflow's "
                                  "own MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN.")
    mlflow_experiment: str = Field(default="torchyard", min_length=1, description="The experiment of the jobs' runs.")
    mlflow_poll_s: float = Field(default=1.0, gt=0, le=60, description="How often a worker's tracking thread looks "
                                                                        "for what the runs do not hold yet.")
    mlflow_backoff_max_s: float = Field(default=30.0, gt=0, description="Longest wait between attempts while the "
                                                                        "tracking server is away.")
    mlflow_request_timeout_s: float = Field(default=10.0, gt=0, description="One request to the tracking server.")

    @field_validator("devices")
    @classmethod
    def _known_devices(cls, value: str) -> str:
        """Refused at start with one clear message, not a worker that cannot pin restarting forever."""
        value = value.strip()
        if value in ("auto", "cpu"):
            return value
        entries = [e.strip() for e in value.split(",")]
        bad = [e for e in entries if not (e.isdigit() or gpu_selector(e))]
        if bad or not entries:
            raise ValueError(f"TORCHYARD_DEVICES={value!r}: use 'auto', 'cpu', or GPUs by index (0,1) or by "
                             f"GPU-/MIG- UUID (`nvidia-smi -L`); not {', '.join(map(repr, bad))}")
        return ",".join(entries)

    @field_validator("predict_decode_processes", mode="wrap")
    @classmethod
    def _decode_processes(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> int | None:
        """One message that names both names: pydantic's own names the new one even when the
        operator set the old one, and says nothing of what the setting counts."""
        try:
            return cast("int | None", handler(value))
        except ValidationError:
            raise ValueError(
                f"TORCHYARD_PREDICT_DECODE_PROCESSES (or its former name TORCHYARD_PREDICT_DECODE_THREADS)="
                f"{value!r}: a number of decoding processes, 1 or more; leave it unset for the cores this "
                f"worker may use") from None

    @model_validator(mode="after")
    def _a_largest_request_fits_the_budget(self) -> Settings:
        if self.predict_memory_budget_bytes < self.max_predict_request_bytes:
            raise ValueError("TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES must be at least TORCHYARD_MAX_PREDICT_REQUEST_BYTES")
        if self.predict_memory_per_client_bytes and self.predict_memory_per_client_bytes < self.max_predict_request_bytes:
            raise ValueError("TORCHYARD_PREDICT_MEMORY_PER_CLIENT_BYTES must be 0 or at least "
                             "TORCHYARD_MAX_PREDICT_REQUEST_BYTES")
        return self

    @property
    def binds_loopback(self) -> bool:
        """True when the API listens on this host only (127.0.0.0/8, ::1, localhost)."""
        if self.host.strip().lower() in ("localhost", "localhost."):
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False  # a host name other than localhost may resolve to anything

    @property
    def allowed_host_names(self) -> list[str]:
        return [h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip()]

    @property
    def allowed_origin_list(self) -> list[str]:
        return [o.strip().lower().rstrip("/") for o in self.allowed_origins.split(",") if o.strip()]

    # --- derived paths -------------------------------------------------------------------
    @property
    def datasets_dir(self) -> Path:
        return self.data_dir / "datasets"

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def builtin_data_dir(self) -> Path:
        """Where torchvision's built-in datasets are read from (and downloaded to, when allowed)."""
        return self.data_dir / "builtin"

    @property
    def hub_dir(self) -> Path:
        """torch.hub's cache for pretrained weights (<hub_dir>/checkpoints/<file>): read by workers only."""
        return self.data_dir / "hub"

    @property
    def predict_memory_per_client_limit(self) -> int:
        """What one client address may hold of the /predict budget; 0: no cap of its own."""
        if self.predict_memory_per_client_bytes is not None:
            return self.predict_memory_per_client_bytes
        return max(self.predict_memory_budget_bytes - self.max_predict_request_bytes, self.max_predict_request_bytes)

    @property
    def request_body_limit(self) -> int:
        """The body-size cap for every request: a dataset upload plus room for its multipart framing."""
        return self.max_request_bytes or self.max_upload_bytes + 1024**2

    @property
    def embedded_redis_dir(self) -> Path:
        return self.data_dir / "redis"

    @property
    def embedded_redis_socket(self) -> Path:
        return self.embedded_redis_dir / "redis.sock"

    def resolved_advertise_address(self) -> str:
        """Where other hosts reach this worker (TORCHYARD_ADVERTISE_ADDRESS, else the host name's address)."""
        if self.advertise_address:
            return self.advertise_address
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    def resolved_redis_url(self) -> str:
        """The configured Redis, or the embedded one that `torchyard up` runs under data_dir."""
        if self.redis_url:
            return self.redis_url
        return f"unix://{self.embedded_redis_socket.resolve()}?db=0"


@lru_cache
def get_settings() -> Settings:
    return Settings()
