"""What a sweep does: ask Optuna for trials, make each one an ordinary training job, tell the study
each job's result when it ends, and end the sweep when every trial was told.

Who drives it: whoever calls `advance` (POST /sweeps once, then every API process's tick,
app/main.py). One advance at a time per sweep (a Redis lock), and every step is idempotent, so a
process killed anywhere in one leaves nothing the next advance does not finish:

- the study is the record of what was asked: a trial is asked only while the study holds fewer
  than `trials`, so none is asked twice and never more than `trials`;
- a trial's job is created with the Idempotency-Key `sweep:<id>:<number>`, then recorded as the
  trial's: a process killed in between leaves a running trial without a job, and the next advance
  creates it again under the same key, which gives back the same job (one job per trial);
- a trial is told once, when its job is terminal and the trial is still running in the study.

Pruning is judged on the worker, between epochs (worker/training/pruning.py); a pruned job ends
`succeeded` with its best weights and a `stop_reason` that says so, and is told here as PRUNED."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

from core.access.projects import acting_as, home, project_of
from core.devices import DeviceRegistry
from core.errors import Conflict, InvalidInput, NotFound
from core.jobs import JobStore
from core.kinds.train.submit import JobSubmission
from core.redis import OUTAGE_ERRORS
from core.schemas import Job, JobStatus
from core.sweeps.records import TERMINAL_STATUSES, SweepLock, SweepRecords
from core.sweeps.spec import Sweep, SweepSpec, SweepTrial, check_sweep, is_pruned, trial_body

if TYPE_CHECKING:  # Optuna (and numpy under it) is imported at the first sweep a process advances or
    # shows, not when an API process starts (tests/models/test_registry.py keeps that start light)
    import optuna
    from optuna.trial import FrozenTrial, TrialState

log = logging.getLogger(__name__)


def _state_word(state: TrialState) -> str:
    from optuna.trial import TrialState

    return {TrialState.RUNNING: "running", TrialState.WAITING: "running", TrialState.COMPLETE: "complete",
            TrialState.PRUNED: "pruned", TrialState.FAIL: "failed"}[state]


def trial_key(sweep_id: str, number: int) -> str:
    """The Idempotency-Key of a trial's job: one job per trial, whoever creates it and how often."""
    return f"sweep:{sweep_id}:{number}"


class SweepCoordinator:
    def __init__(self, records: SweepRecords, jobs: JobStore, submission: JobSubmission, devices: DeviceRegistry,
                 redis_url: str) -> None:
        self.records = records
        self.jobs = jobs
        self.submission = submission
        self.devices = devices
        self.redis_url = redis_url

    # ------------------------------------------------------------------ a user's requests
    def create(self, spec: SweepSpec, idempotency_key: str | None = None) -> tuple[Sweep, bool]:
        body = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(body.encode()).hexdigest()
        if idempotency_key is not None and len(idempotency_key) > 200:
            raise InvalidInput("Idempotency-Key is longer than 200 characters")
        earlier = self.records.replay(idempotency_key, digest)
        if earlier is not None:
            return self.get(earlier), False
        check_sweep(spec)
        self.submission.check(spec.base)  # the base as POST /jobs would judge it
        parallel = spec.parallel or self._live_devices(spec.base.device)
        sweep_id, created = self.records.create({"spec": body, "parallel": str(parallel), "project": home()},
                                                idempotency_key, digest)
        if created:
            self._advance_now(sweep_id)
        return self.get(sweep_id), created

    def cancel(self, sweep_id: str) -> Sweep:
        self.records.mark_cancelled(sweep_id)
        self._advance_now(sweep_id)
        return self.get(sweep_id)

    def _advance_now(self, sweep_id: str) -> None:
        """A first step at once for the user's request; what fails here the tick does next (the
        request itself was recorded)."""
        try:
            self.advance(sweep_id)
        except OUTAGE_ERRORS:
            raise
        except Exception:
            log.exception("sweep %s: advancing it failed; the tick tries again", sweep_id)

    def delete(self, sweep_id: str) -> None:
        """A sweep that ended: its record and events (its trials' jobs stay: delete them as jobs)."""
        from core.sweeps import study as studies

        raw = self.records.get(sweep_id)
        if raw["status"] not in TERMINAL_STATUSES or sweep_id in self.records.active():
            raise Conflict(f"sweep {sweep_id} is {raw['status']} with trials still running; cancel it first")
        self.records.delete(sweep_id)
        studies.forget(self.redis_url, sweep_id)

    def get(self, sweep_id: str) -> Sweep:
        from core.sweeps import study as studies

        raw = self.records.get(sweep_id)
        spec = SweepSpec.model_validate_json(raw["spec"])
        study = studies.open_study(self.redis_url, sweep_id, spec)
        jobs, errors = self.records.trial_jobs(sweep_id)
        trials = [self._view(t, jobs.get(t.number), errors.get(t.number)) for t in study.get_trials(deepcopy=False)]
        scored = [t for t in trials if t.state == "complete" and t.value is not None]
        best = None
        if scored:
            pick = max if spec.resolved_direction == "maximize" else min
            best = pick(scored, key=lambda t: t.value if t.value is not None else 0.0)
        return Sweep(id=sweep_id, project=project_of(raw.get("project")), status=raw["status"], created_at=raw["created_at"],
                     finished_at=raw.get("finished_at") or None, message=raw.get("message") or None,
                     spec=json.loads(raw["spec"]), parallel=int(raw["parallel"]), trials=trials, best=best,
                     importances=json.loads(raw["importances"]) if raw.get("importances") else None)

    def page(self, limit: int) -> list[Sweep]:
        found = []
        for sweep_id in self.records.page(limit):
            try:
                found.append(self.get(sweep_id))
            except NotFound:  # deleted meanwhile
                continue
        return found

    # ------------------------------------------------------------------ the driver
    def advance_all(self) -> None:
        """Every sweep with something to ask or tell, one step each (the API's tick)."""
        for sweep_id in self.records.active():
            try:
                self.advance(sweep_id)
            except NotFound:
                continue
            except OUTAGE_ERRORS:
                raise
            except Exception:  # one sweep's trouble must not stall the others: logged, tried next tick
                log.exception("sweep %s: advancing it failed; it is tried again at the next tick", sweep_id)

    def advance(self, sweep_id: str) -> None:
        """Tell the trials whose jobs ended, ask for new ones up to `parallel` running and `trials` in
        all, and end the sweep once every trial was told. Idempotent; one process at a time."""
        # The tick acts for no project: a sweep's step acts in the sweep's, so its trials' jobs are
        # that project's and read that project's datasets (core/access/projects.py).
        try:
            project = project_of(self.records.get(sweep_id).get("project"))
        except NotFound:  # deleted meanwhile: nothing to step
            return
        with self.records.lock(sweep_id) as lock, acting_as(project):
            if lock is not None:
                self._advance(sweep_id, lock)

    def _advance(self, sweep_id: str, lock: SweepLock) -> None:
        from optuna.trial import TrialState

        from core.sweeps import study as studies

        raw = self.records.get(sweep_id)
        spec = SweepSpec.model_validate_json(raw["spec"])
        cancelled = raw["status"] == "cancelled"
        study = studies.open_study(self.redis_url, sweep_id, spec)
        jobs, _ = self.records.trial_jobs(sweep_id)
        trials = study.get_trials(deepcopy=False)
        for trial in trials:
            if trial.state not in (TrialState.RUNNING, TrialState.WAITING):
                continue
            job_id = jobs.get(trial.number)
            if job_id is None:  # asked, then the process died before its job was recorded
                if cancelled or trial.number >= spec.trials:
                    self._tell(sweep_id, study, trial.number, TrialState.FAIL, None, 0)
                else:
                    self._submit(sweep_id, spec, study, trial.number, trial.params)
                continue
            self._follow(sweep_id, spec, study, trial.number, job_id, cancelled)
        if not cancelled:
            self._ask(sweep_id, spec, int(raw["parallel"]), lock)
        trials = studies.open_study(self.redis_url, sweep_id, spec).get_trials(deepcopy=False)
        if any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials):
            return
        if cancelled or len(trials) >= spec.trials:
            self._finish(sweep_id, spec, cancelled, trials)

    def _ask(self, sweep_id: str, spec: SweepSpec, parallel: int, lock: SweepLock) -> None:
        from optuna.trial import TrialState

        from core.sweeps import study as studies

        distributions = studies.distributions(spec)
        while True:
            trials = studies.open_study(self.redis_url, sweep_id, spec).get_trials(deepcopy=False)
            running = sum(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials)
            if running >= parallel or len(trials) >= spec.trials or not lock.renew():
                return
            study = studies.open_study(self.redis_url, sweep_id, spec, asked=len(trials))
            trial = study.ask(distributions)
            if trial.number >= spec.trials:  # another process asked meanwhile (its lock lapsed): no job
                self.records.set_trial_error(sweep_id, trial.number, "asked beyond the sweep's trials; not run")
                self._tell(sweep_id, study, trial.number, TrialState.FAIL, None, 0)
                return
            self._submit(sweep_id, spec, study, trial.number, trial.params)

    def _submit(self, sweep_id: str, spec: SweepSpec, study: optuna.Study, number: int,
                params: dict[str, Any]) -> None:
        """The trial's job (created once, whatever retries it), recorded as the trial's; a trial whose
        body the training submitter refuses (its batch does not fit, say) is told failed with why."""
        from optuna.trial import TrialState

        tags = {"sweep_id": sweep_id, "trial": str(number)}
        try:
            job, _ = self.submission.submit(trial_body(spec.base, params), trial_key(sweep_id, number), tags)
        except InvalidInput as exc:
            self.records.set_trial_error(sweep_id, number, str(exc))
            self._tell(sweep_id, study, number, TrialState.FAIL, None, 0)
            return
        self.records.set_trial_job(sweep_id, number, job.id, params)

    def _follow(self, sweep_id: str, spec: SweepSpec, study: optuna.Study, number: int, job_id: str,
                cancelled: bool) -> None:
        from optuna.trial import TrialState

        try:
            job = self.jobs.get(job_id)
        except NotFound:
            self._tell(sweep_id, study, number, TrialState.FAIL, None, 0)
            return
        if not job.status.terminal:
            if cancelled:
                try:
                    self.jobs.request_cancel(job_id)
                except Conflict:
                    pass
            return
        values = _metric_values(job, spec.metric)
        epoch = job.metrics[-1].epoch if job.metrics else 0
        if job.status is JobStatus.succeeded and is_pruned(job.stop_reason):
            self._tell(sweep_id, study, number, TrialState.PRUNED, values[-1] if values else None, epoch)
        elif job.status is JobStatus.succeeded and values:
            best = max(values) if spec.resolved_direction == "maximize" else min(values)
            self._tell(sweep_id, study, number, TrialState.COMPLETE, best, epoch)
        else:
            self._tell(sweep_id, study, number, TrialState.FAIL, None, epoch)

    def _tell(self, sweep_id: str, study: optuna.Study, number: int, state: TrialState, value: float | None,
              epoch: int) -> None:
        from optuna.trial import TrialState

        if state is TrialState.COMPLETE:
            study.tell(number, value)
        else:
            study.tell(number, state=state)
        self.records.trial_told(sweep_id, number, _state_word(state), value, epoch)

    def _finish(self, sweep_id: str, spec: SweepSpec, cancelled: bool, trials: list[FrozenTrial]) -> None:
        from optuna.trial import TrialState

        from core.sweeps import study as studies

        complete = [t for t in trials if t.state is TrialState.COMPLETE]
        fields: dict[str, str] = {}
        if complete:
            found = studies.importances(studies.open_study(self.redis_url, sweep_id, spec))
            if found is not None:
                fields["importances"] = json.dumps(found)
        if cancelled:
            self.records.finish(sweep_id, "cancelled", {**fields, "message": f"cancelled after {len(trials)} trials"})
        elif complete or any(t.state is TrialState.PRUNED for t in trials):
            self.records.finish(sweep_id, "succeeded",
                                {**fields, "message": f"{len(complete)} of {len(trials)} trials complete"})
        else:
            self.records.finish(sweep_id, "failed", {"message": f"none of its {len(trials)} trials completed"})

    # ------------------------------------------------------------------ pieces
    def _view(self, trial: FrozenTrial, job_id: str | None, error: str | None) -> SweepTrial:
        from optuna.trial import TrialState

        job = None
        if job_id is not None:
            try:
                job = self.jobs.get(job_id)
            except NotFound:
                error = error or f"job {job_id} was deleted"
        value = trial.value if trial.state in (TrialState.COMPLETE, TrialState.PRUNED) else None
        if value is None and trial.intermediate_values:
            value = trial.intermediate_values[max(trial.intermediate_values)]
        return SweepTrial(number=trial.number, job_id=job_id, params=trial.params, state=_state_word(trial.state),
                          value=value, epoch=job.metrics[-1].epoch if job is not None and job.metrics else 0,
                          job_status=job.status.value if job is not None else None,
                          error=error or (job.error if job is not None else None))

    def _live_devices(self, requested: str) -> int:
        live = [d for d in self.devices.all() if d.status not in ("offline", "broken")
                and (requested == "auto" or d.type == requested or d.id == requested)]
        return max(1, len(live))


def _metric_values(job: Job, metric: str) -> list[float]:
    return [float(v) for m in job.metrics if (v := getattr(m, metric)) is not None]
