"""Every Redis key torchyard reads or writes, named in one place.

Why one module: the API, the workers and the metrics collector all read the same records, and a
key spelled twice is a key that drifts. Everything of ours lives under ``ty:`` so a shared Redis
(or a flush of ours) never touches anyone else's data; Celery's queues are kombu's own lists,
named by core/queue.py, and their priority sub-lists are spelled here because we read them.

Layout::

    ty:job:<id>                      hash   the job record (core/jobs/)
    ty:job:<id>:events               stream status/progress/metrics events, SSE ids
    ty:jobs                          zset   every job id (lexicographic = chronological)
    ty:jobs:status:<status>          zset   job ids by status
    ty:leases                        zset   running job id -> lease expiry
    ty:idem:<key>                    string Idempotency-Key -> {"job", "request"} (24 h), written with the record
    ty:project:<project>:idem:<key>  string the same, of a project other than "default" (core/access/projects.py)
    ty:dispatch                      zset   queued job id -> when (Redis time) to check its message was taken
    ty:settle                        zset   ended job id -> when a worker must settle its files (promote, clean)
    ty:recovery                      hash   counters of the recovery paths (re-sent deliveries, expired leases, ...)
    ty:sweep:lock                    string which worker sweeps now (short TTL: one sweeper at a time)
    ty:device:<id>                   string a device's last heartbeat record (JSON)
    ty:device:<id>:alive             string the owning worker instance; TTL = liveness and lock
    ty:devices                       set    every device id ever registered
    ty:predict:<device id>           list   prediction requests for that device's worker
    ty:reply:<token>                 list   an API process's /predict reply inbox, or a warm-up's one-off reply (TTL)
    ty:dataset:<id>                  string an uploaded dataset's record (JSON)
    ty:datasets                      set    uploaded dataset ids
    ty:aliases                       hash   alias name -> the job it points at (core/aliases.py)
    ty:alias:<name>                  hash   an alias's record: target, previous target, who and when
    ty:alias:<name>:history          list   every move of the alias, oldest first (JSON, capped)
    ty:export:<sha256>:<format>      string the export job that builds this checkpoint in this format
    ty:export:<sha256>:<format>:lock string held (short TTL) while one API process creates that job
    ty:project:<p>:export:<sha256>:<format>[:lock]   the same, of a project other than "default"
    ty:dataset:<id>:last_used        string when a job last asked for the dataset (epoch s)
    ty:retention:lock                string the API process running the cleanup (TTL = interval)
    ty:job:<id>:evaluations          zset   evaluation job ids of a trained job (score: submit time)
    ty:job:<id>:dependents           set    jobs that read this job's checkpoint when they run
                                            (init_from children, evaluations): core/lineage.py
    ty:gangs:waiting                 zset   data-parallel deliveries waiting for free devices, as the
                                            task id <job>.<token> (score 0: lexicographic = oldest job first)
    ty:gangs:reserved                zset   job id -> when (Redis time) its unstarted reservation lapses
    ty:gangs:lock                    string which worker runs the gang scheduler now (short TTL)
    ty:gang:<job id>                 hash   the job's gang: attempt id, token, ranks, rendezvous address and secret,
                                            ready ranks, the epoch rank 0 recorded, a rank's failure
    ty:device:<id>:slot              hash   what the device's worker is doing: reserved for a gang's rank,
                                            held for a waiting gang, or busy with a job (and maybe promised
                                            to a waiting gang for when it ends; absent: free); core/devices/slots.py
    ty:mlflow:pending                zset   job id -> when (Redis time) a worker's tracking thread tries its MLflow
                                            run next (core/tracking.py)
    ty:mlflow:lock:<job id>          string the worker shipping that job's run now (TTL)
    ty:mlflow:aliases                hash   alias name -> the job its MLflow `current` alias points at
    ty:mlflow:aliases:lock           string the worker syncing the aliases to MLflow's registry now (TTL)

    ty:sweeps                        zset   every sweep id (lexicographic = chronological): core/sweeps/
    ty:sweeps:active                 set    sweeps with a trial still to ask or to tell (the API's tick)
    ty:sweeps:nudge                  list   sweeps whose trial's job just ended (a worker's push wakes an API's tick)
    ty:sweeps:<id>                   hash   a sweep's record: its request, status, outcome
    ty:sweeps:<id>:jobs              hash   trial number -> its training job (and trial number -> error)
    ty:sweeps:<id>:events            stream trial and status events, SSE ids
    ty:sweeps:<id>:lock              string the process that advances the sweep now (short TTL)
    ty:sweeps:idem:<key>             string POST /sweeps' Idempotency-Key -> {"sweep", "body"} (24 h)
    ty:project:<p>:sweeps:idem:<key> string the same, of a project other than "default"
    ty:optuna:<sweep id>:*           the sweep's Optuna study: its journal (JournalRedisBackend's log_number, log:<n>,
                                            snapshot), one per sweep

    ty:apikey:<id>                   hash   an API key: name, role, project, salt, HMAC digest of its secret
                                            (never the secret), created, expiry, revoked: core/access/keystore.py
    ty:apikeys                       zset   every key id -> when it was created
    ty:audit                         stream who did what and with what result (capped; trimmed by retention):
                                            core/access/audit.py
    ty:project:<project>:quota       string a project's quotas (JSON; PUT /projects/{name}): core/access/quotas.py
    ty:project:<p>:predict:<second>  string its predictions in that second (TTL 2 s), with a predict_per_second quota
    ty:project:<p>:device_seconds:<day>  string device-seconds its jobs that ended that UTC day accrued (TTL 2 days):
                                            core/access/holds.py
    ty:quota:held                    zset   queued job id -> when its start was held for a project's quota (running_jobs,
                                            devices_held, device_seconds_per_day); re-sent by core/jobs/recovery.release_held
"""

from __future__ import annotations

PREFIX = "ty:"

JOBS_INDEX = f"{PREFIX}jobs"
LEASES = f"{PREFIX}leases"
DEVICES_INDEX = f"{PREFIX}devices"
DATASETS_INDEX = f"{PREFIX}datasets"
ALIASES = f"{PREFIX}aliases"

# --- recovery: the dispatch outbox, files to settle, counters, the sweeper's lock ---------------
DISPATCH_DUE = f"{PREFIX}dispatch"
FILES_TO_SETTLE = f"{PREFIX}settle"
RECOVERY_STATS = f"{PREFIX}recovery"
SWEEP_LOCK = f"{PREFIX}sweep:lock"
QUOTA_HELD = f"{PREFIX}quota:held"

# kombu's Redis transport keeps a message with priority p > 0 in "<queue>\x06\x16<p>"; a queue's
# depth is the sum over these lists (the metrics collector reads them).
KOMBU_PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")


def job(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def job_events(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:events"


def jobs_with_status(status: str) -> str:
    return f"{JOBS_INDEX}:status:{status}"


def idempotency(key: str, project: str = "default") -> str:
    """A project's Idempotency-Key: "default"'s as before projects; another's in a namespace of its
    own, which no key of "default" can spell (theirs all start `ty:idem:`)."""
    return f"{PREFIX}idem:{key}" if project == "default" else f"{PREFIX}project:{project}:idem:{key}"


def device_state(device_id: str) -> str:
    return f"{PREFIX}device:{device_id}"


def device_alive(device_id: str) -> str:
    return f"{PREFIX}device:{device_id}:alive"


def predict_queue(device_id: str) -> str:
    return f"{PREFIX}predict:{device_id}"


def predict_reply(token: str) -> str:
    return f"{PREFIX}reply:{token}"


def dataset(dataset_id: str) -> str:
    return f"{PREFIX}dataset:{dataset_id}"


def kombu_queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold a Celery queue's messages, one per priority level."""
    return [queue + suffix for suffix in KOMBU_PRIORITY_SUFFIXES]


# --- aliases and exports ---------------------------------------------------------------------
def alias(name: str) -> str:
    return f"{PREFIX}alias:{name}"


def alias_history(name: str) -> str:
    return f"{PREFIX}alias:{name}:history"


def export(checkpoint_sha256: str, fmt: str, project: str = "default") -> str:
    """A project's export of a checkpoint (two projects' identical checkpoints get one each)."""
    own = "" if project == "default" else f"project:{project}:"
    return f"{PREFIX}{own}export:{checkpoint_sha256}:{fmt}"


def export_lock(checkpoint_sha256: str, fmt: str, project: str = "default") -> str:
    return f"{export(checkpoint_sha256, fmt, project)}:lock"


# --- retention (core/retention.py) -------------------------------------------------------------
RETENTION_LOCK = f"{PREFIX}retention:lock"


def dataset_last_used(dataset_id: str) -> str:
    return f"{PREFIX}dataset:{dataset_id}:last_used"
def job_evaluations(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:evaluations"


def job_dependents(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:dependents"


# --- data-parallel gangs (core/gangs/) -----------------------------------------------------------
GANGS_WAITING = f"{PREFIX}gangs:waiting"
GANGS_RESERVED = f"{PREFIX}gangs:reserved"
GANGS_LOCK = f"{PREFIX}gangs:lock"


def gang(job_id: str) -> str:
    return f"{PREFIX}gang:{job_id}"


def device_slot(device_id: str) -> str:
    return f"{PREFIX}device:{device_id}:slot"


# --- MLflow tracking (core/tracking.py, worker/tracking/) ----------------------------------------
MLFLOW_PENDING = f"{PREFIX}mlflow:pending"
MLFLOW_ALIASES = f"{PREFIX}mlflow:aliases"
MLFLOW_ALIASES_LOCK = f"{PREFIX}mlflow:aliases:lock"


def mlflow_lock(job_id: str) -> str:
    return f"{PREFIX}mlflow:lock:{job_id}"

# --- sweeps (core/sweeps/) ---------------------------------------------------------------------
SWEEPS_INDEX = f"{PREFIX}sweeps"
SWEEPS_ACTIVE = f"{PREFIX}sweeps:active"
SWEEPS_NUDGE = f"{PREFIX}sweeps:nudge"
OPTUNA_PREFIX = f"{PREFIX}optuna:"


def sweep(sweep_id: str) -> str:
    return f"{PREFIX}sweeps:{sweep_id}"


def sweep_jobs(sweep_id: str) -> str:
    return f"{PREFIX}sweeps:{sweep_id}:jobs"


def sweep_events(sweep_id: str) -> str:
    return f"{PREFIX}sweeps:{sweep_id}:events"


def sweep_lock(sweep_id: str) -> str:
    return f"{PREFIX}sweeps:{sweep_id}:lock"


def sweep_idempotency(key: str, project: str = "default") -> str:
    """As `idempotency`: another project's in a namespace of its own."""
    return f"{PREFIX}sweeps:idem:{key}" if project == "default" else f"{PREFIX}project:{project}:sweeps:idem:{key}"


# --- access: API keys and the audit log (core/access/) -----------------------------------------
API_KEYS_INDEX = f"{PREFIX}apikeys"
AUDIT = f"{PREFIX}audit"


def api_key(key_id: str) -> str:
    return f"{PREFIX}apikey:{key_id}"


def project_quota(project: str) -> str:
    return f"{PREFIX}project:{project}:quota"


def project_predictions(project: str, second: int) -> str:
    return f"{PREFIX}project:{project}:predict:{second}"


def project_device_seconds(project: str, day: str) -> str:
    return f"{PREFIX}project:{project}:device_seconds:{day}"
