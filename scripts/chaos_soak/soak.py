"""One run of the soak: the workload and the faults side by side, each in a thread of its own,
until the client has its --jobs acknowledged and --faults were injected (or --max-seconds pass);
then the stack is made whole again and every acknowledged job is checked. The stack itself is
started and stopped by the caller (scripts/chaos.py), which owns its data dir."""

from __future__ import annotations

import argparse
import random
import threading
import time

import httpx

from . import log
from .checks import Checker, Report
from .faults import FaultInjector
from .stack import Stack, wait_ready
from .workload import Workload


class Soak:
    """The soak's client, workload, faults and checks against one started `Stack`."""

    def __init__(self, args: argparse.Namespace, stack: Stack) -> None:
        self.args = args
        self.stack = stack
        self.client = httpx.Client(base_url=stack.base_url, timeout=args.request_timeout)
        self.stop_event = threading.Event()
        self.workload = Workload(args, self.client, self.stop_event)
        self.injector = FaultInjector(args, stack, self.client, random.Random(args.seed), self.stop_event)
        self.checker = Checker(args, self.client, stack.redis_url)

    def wait_ready(self, timeout: float) -> float | None:
        return wait_ready(self.client, timeout)

    def run(self) -> Report:
        started = time.monotonic()
        self.workload.upload_dataset()
        threads = [threading.Thread(target=self.workload.submitter, daemon=True, name="submitter"),
                   threading.Thread(target=self.injector.fault_loop, daemon=True, name="faults")]
        for thread in threads:
            thread.start()
        submitted, faults = self.workload.submitted, self.injector.faults
        while time.monotonic() - started < self.args.max_seconds:
            acked = sum(1 for s in submitted if s.job_id)
            if acked >= self.args.jobs and len(faults) >= self.args.faults:
                break
            time.sleep(1)
        log(f"stopping: {sum(1 for s in submitted if s.job_id)} jobs acknowledged, {len(faults)} faults")
        self.stop_event.set()
        for thread in threads:
            thread.join(timeout=120)
        self.stack.thaw_all()
        self.stack.keep_worker_b()
        self.wait_ready(self.args.recovery_timeout)
        report = self.checker.check(submitted, self.workload.retried, faults,
                                    drain_deadline=time.monotonic() + self.args.drain_seconds)
        report.seconds = time.monotonic() - started
        return report

    def close(self) -> None:
        self.client.close()
