"""The keys', the audit log's and the projects' side of the HTTP contract (POST/GET /keys, GET /audit,
GET /whoami, PUT/GET /projects/{name}). Pure models: the client reads its answers with them too."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from core.access.roles import Role

PROJECT_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
DEFAULT_PROJECT = "default"  # the bootstrap key's, and every object made before projects existed


class KeyCreate(BaseModel):
    """POST /keys' body."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$",
                      description="who or what holds the key (`ci-bot`); shown in GET /keys and the audit log")
    role: Role = Field(description="admin (every project, keys), trainer, predictor or viewer (their project)")
    project: str = Field(default=DEFAULT_PROJECT, pattern=PROJECT_PATTERN,
                         description="the project the key acts in (lowercase letters, digits, - and _)")
    expires_in_days: float | None = Field(default=None, gt=0, le=3650,
                                          description="the key stops working this long after its creation; "
                                                      "none: until revoked")


class KeyInfo(BaseModel):
    """A key as GET /keys shows it: never its secret (only a salted hash of it is stored)."""

    id: str
    name: str
    role: Role
    project: str
    created_at: datetime
    created_by: str | None = Field(default=None, description="the key (id) that created it")
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    active: bool = Field(description="neither expired nor revoked")


class KeyCreated(KeyInfo):
    secret: str = Field(description="the bearer token, shown this once: it cannot be read again")


class KeyList(BaseModel):
    keys: list[KeyInfo]


class Whoami(BaseModel):
    """The caller's key: what the dashboard and `torchyard keys` show about the one in use."""

    key_id: str | None = Field(description="null when the server has no key set (access control is off)")
    name: str
    role: Role
    project: str


class AuditEntry(BaseModel):
    id: str = Field(description="the entry's id (Redis stream id: time-ordered); `before` pages with it")
    at: datetime
    key_id: str | None
    key_name: str
    project: str
    role: Role
    method: str
    route: str = Field(description="the route template (`/jobs/{job_id}`), or the path when none matched")
    object: str | None = Field(description="the route's path parameters (`job_id=...`), or the Location made")
    status: int


class AuditLog(BaseModel):
    entries: list[AuditEntry] = Field(description="newest first")


class Quota(BaseModel):
    """PUT /projects/{name}'s body and GET's `quota`: a limit each, null (or absent) for none."""

    model_config = ConfigDict(extra="forbid")

    queued_jobs: int | None = Field(default=None, ge=0, le=1_000_000,
                                    description="jobs waiting for a device at once (429 with Retry-After past it)")
    dataset_bytes: int | None = Field(default=None, ge=0,
                                      description="bytes of the project's uploaded archives together (429 past it)")
    predict_per_second: int | None = Field(default=None, ge=0, le=1_000_000,
                                           description="POST /predict and /v2 infer requests per second, every API "
                                                       "process together (429 with Retry-After past it)")
    running_jobs: int | None = Field(default=None, ge=0, le=1_000_000,
                                     description="jobs running at once; past it a job waits, queued, until one ends")
    devices_held: int | None = Field(default=None, ge=0, le=1_000_000,
                                     description="devices its running jobs hold at once (a gang counts its ranks); "
                                                 "past it a job waits, queued, until they free enough")
    device_seconds_per_day: int | None = Field(default=None, ge=0,
                                               description="device-seconds its jobs may run per UTC day (a gang's "
                                                           "ranks each); past it new starts wait for the next day "
                                                           "and POST /jobs answers 429 with Retry-After")


class Usage(BaseModel):
    queued_jobs: int
    running_jobs: int
    datasets: int
    dataset_bytes: int
    devices_held: int = 0
    device_seconds_today: float = Field(default=0.0, description="device-seconds used this UTC day")
    held_jobs: int = Field(default=0, description="queued jobs whose start waits for a quota")


class ProjectView(BaseModel):
    name: str
    quota: Quota
    usage: Usage
