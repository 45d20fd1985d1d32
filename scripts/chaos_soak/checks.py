"""The soak's verdict: for every acknowledged job, it succeeded; its metrics hold epochs 1..E once
each and its event stream has one `metrics` event per epoch and one terminal status (else it "ran
twice"); the checkpoint downloaded through the API hashes to the recorded sha256; and every job
the server holds was acknowledged to the client (no job nobody was told of). `Report` is the
outcome, as a table and as JSON; any loss, double run, mismatch, unannounced job, key answered
with two jobs or fault not recovered from fails it."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from . import TERMINAL, log
from .faults import Fault
from .workload import Submitted


@dataclass
class Report:
    acknowledged: int = 0
    succeeded: int = 0
    lost: list[str] = field(default_factory=list)
    ran_twice: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    unannounced: list[str] = field(default_factory=list)
    conflicting_keys: list[str] = field(default_factory=list)
    retried_requests: int = 0
    attempts_over_one: int = 0
    faults: Counter = field(default_factory=Counter)
    longest_recovery: dict[str, float] = field(default_factory=dict)
    unrecovered: int = 0
    recovery_stats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    gangs_acknowledged: int = 0  # data-parallel jobs among the acknowledged
    gangs_succeeded: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.ran_twice or self.mismatched or self.unannounced or self.conflicting_keys
                    or self.unrecovered)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "acknowledged": self.acknowledged, "succeeded": self.succeeded, "lost": self.lost,
            "ran_twice": self.ran_twice, "checkpoint_mismatches": self.mismatched, "unannounced": self.unannounced,
            "conflicting_keys": self.conflicting_keys, "retried_requests": self.retried_requests,
            "attempts_over_one": self.attempts_over_one, "faults": dict(self.faults),
            "faults_total": sum(self.faults.values()), "longest_recovery_s": self.longest_recovery,
            "unrecovered_faults": self.unrecovered, "recovery": self.recovery_stats, "seconds": round(self.seconds, 1),
            "gangs_acknowledged": self.gangs_acknowledged, "gangs_succeeded": self.gangs_succeeded,
        }

    def table(self) -> str:
        recovery = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(self.longest_recovery.items())) or "-"
        rows = [
            ("jobs acknowledged", self.acknowledged), ("succeeded", self.succeeded), ("lost", len(self.lost)),
            ("of them data-parallel (2 ranks): acknowledged, succeeded", f"{self.gangs_acknowledged}, "
                                                                          f"{self.gangs_succeeded}"),
            ("run twice", len(self.ran_twice)), ("checkpoint mismatches", len(self.mismatched)),
            ("jobs nobody was told of", len(self.unannounced)),
            ("keys answered with two jobs", len(self.conflicting_keys)),
            ("client requests retried", self.retried_requests),
            ("jobs delivered more than once", self.attempts_over_one),
            ("re-sent deliveries (reconciler)", self.recovery_stats.get("resent_deliveries", 0)),
            ("expired leases redelivered", self.recovery_stats.get("expired_leases", 0)),
            ("files settled by a sweep", self.recovery_stats.get("files_settled_by_sweep", 0)),
            ("faults injected", f"{sum(self.faults.values())}: " +
             ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))),
            ("longest recovery (stack whole again)", recovery),
            ("faults not recovered from", self.unrecovered),
            ("wall time", f"{self.seconds:.0f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"  {name:<{width}}  {value}" for name, value in rows]
        verdict = "PASSED: nothing lost, nothing ran twice" if self.ok else "FAILED"
        for name, ids in (("lost", self.lost), ("ran twice", self.ran_twice), ("mismatched", self.mismatched),
                          ("unannounced", self.unannounced), ("conflicting keys", self.conflicting_keys)):
            if ids:
                lines.append(f"  {name}: {', '.join(ids[:20])}")
        return "\n".join(["chaos soak", *lines, verdict])


class Checker:
    """Asks the server, through its API (and Redis for the recovery counters), what became of the
    jobs the client was told of."""

    def __init__(self, args: argparse.Namespace, client: httpx.Client, redis_url: str) -> None:
        self.args = args
        self.client = client
        self.redis_url = redis_url

    def check(self, submitted: list[Submitted], retried: int, faults: list[Fault], drain_deadline: float) -> Report:
        """Wait (until `drain_deadline`) for every acknowledged job to end, then check each."""
        report = Report(retried_requests=retried)
        acked = [s for s in submitted if s.job_id]
        report.acknowledged = len(acked)
        report.gangs_acknowledged = sum(s.body.get("world_size", 1) > 1 for s in acked)
        jobs: dict[str, dict] = {}
        for item in acked:
            assert item.job_id is not None
            job = self._final(item.job_id, drain_deadline)
            jobs[item.job_id] = job or {}
        by_id: dict[str, list[str]] = {}
        for item in acked:
            assert item.job_id is not None
            by_id.setdefault(item.job_id, []).append(item.key)
        report.conflicting_keys = [job_id for job_id, k in by_id.items() if len(k) > 1]
        for job_id, job in jobs.items():
            if job.get("status") != "succeeded":
                report.lost.append(job_id)
                log(f"  lost {job_id}: {job.get('status')} {job.get('error') or job.get('message')}")
                continue
            report.succeeded += 1
            report.gangs_succeeded += job.get("world_size", 1) > 1
            report.attempts_over_one += job["attempts"] > 1
            if not self._ran_once(job_id, job):
                report.ran_twice.append(job_id)
            if not self._checkpoint_matches(job_id, job):
                report.mismatched.append(job_id)
        report.unannounced = [job_id for job_id in self._all_job_ids() if job_id not in jobs]
        report.faults = Counter(f.kind for f in faults)
        for fault in faults:
            if fault.recovery_s is None:
                report.unrecovered += 1
            else:
                report.longest_recovery[fault.kind] = max(report.longest_recovery.get(fault.kind, 0.0),
                                                          fault.recovery_s)
        report.recovery_stats = self._recovery_stats()
        return report

    def _get(self, path: str, **kw: Any) -> httpx.Response:
        for _ in range(60):
            try:
                answer = self.client.get(path, **kw)
                if answer.status_code < 500:
                    return answer
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"GET {path} kept failing")

    def _final(self, job_id: str, deadline: float) -> dict | None:
        while True:
            job = self._get(f"/jobs/{job_id}").json()
            if job.get("status") in TERMINAL or time.monotonic() > deadline:
                return job
            time.sleep(0.5)

    def _ran_once(self, job_id: str, job: dict) -> bool:
        epochs = [m["epoch"] for m in job["metrics"]]
        expected = list(range(1, self.args.epochs + 1))
        events: list[tuple[str, dict]] = []
        with self.client.stream("GET", f"/jobs/{job_id}/events", timeout=60) as response:
            current: dict[str, str] = {}
            for line in response.iter_lines():
                if not line:
                    if "event" in current and "data" in current:
                        events.append((current["event"], json.loads(current["data"])))
                    current = {}
                    continue
                key, _, value = line.partition(": ")
                current[key] = value
        per_epoch = Counter(data["epoch"] for kind, data in events if kind == "metrics")
        terminal = [data for kind, data in events if kind == "status" and data.get("status") in TERMINAL]
        once = epochs == expected and sorted(per_epoch) == expected and set(per_epoch.values()) == {1} \
            and len(terminal) == 1
        if not once:
            log(f"  {job_id} ran twice? metrics {epochs}, metrics events {dict(per_epoch)}, terminal {terminal}")
        return once

    def _checkpoint_matches(self, job_id: str, job: dict) -> bool:
        answer = self._get(f"/jobs/{job_id}/checkpoint")
        digest = hashlib.sha256(answer.content).hexdigest()
        recorded = (job.get("checkpoint") or {}).get("sha256")
        ok = answer.status_code == 200 and digest == recorded == answer.headers.get("X-Checkpoint-SHA256")
        if not ok:
            log(f"  {job_id}: checkpoint {answer.status_code} sha256 {digest} != recorded {recorded}")
        return ok

    def _all_job_ids(self) -> list[str]:
        ids: list[str] = []
        cursor = None
        while True:
            page = self._get("/jobs", params={"limit": 500, **({"cursor": cursor} if cursor else {})}).json()
            ids += [j["id"] for j in page["jobs"]]
            cursor = page.get("next_cursor")
            if not cursor:
                return ids

    def _recovery_stats(self) -> dict[str, int]:
        import redis

        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            return {k: int(v) for k, v in client.hgetall("ty:recovery").items()}
        finally:
            client.close()

