"""The soak's faults, one at a time, drawn from a shuffled cycle of every kind asked for (so a
short pass sees each): kill-api, freeze-api, kill-worker, freeze-worker, kill-redis,
freeze-redis, device-fault (SIGKILL; SIGSTOP for 1..--freeze-max s then SIGCONT; the worker's CPU
twin of a sticky CUDA error), and with --long-redis-outage one 60 s freeze of Redis. The next
fault waits until the stack is whole again; the time from the end of a fault to that is its
recovery, which scripts/chaos_soak/checks.py reports."""

from __future__ import annotations

import argparse
import random
import signal
import threading
import time
from dataclasses import dataclass

import httpx

from . import log
from .stack import Stack, wait_ready

FAULT_KINDS = ("kill-api", "freeze-api", "kill-worker", "freeze-worker", "kill-redis", "freeze-redis",
               "device-fault")


@dataclass
class Fault:
    kind: str
    target: str
    started: float
    ended: float = 0.0
    recovered: float | None = None
    gone: frozenset[int] = frozenset()  # worker processes that must have been replaced

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.ended



class FaultInjector:
    """Breaks the stack, one fault at a time, until `stop_event` is set; `faults` is what it did."""

    def __init__(self, args: argparse.Namespace, stack: Stack, client: httpx.Client, rng: random.Random,
                 stop_event: threading.Event) -> None:
        self.args = args
        self.stack = stack
        self.client = client
        self.rng = rng
        self.stop_event = stop_event
        self.faults: list[Fault] = []

    def inject(self, kind: str) -> Fault | None:
        procs = self.stack.processes()
        if kind in ("kill-worker", "freeze-worker", "device-fault"):
            names = ["worker-a", "worker-b"]
        elif kind == "long-redis-outage":
            names = ["redis"]
        else:
            names = [kind.split("-", 1)[1]]  # api or redis
        targets = [name for name in names if name in procs]
        if not targets:
            return None
        target = self.rng.choice(targets)
        fault = Fault(kind, target, time.monotonic())
        if kind in ("kill-worker", "device-fault"):
            fault.gone = frozenset({procs[target].pid})
        if kind == "device-fault":
            node = "chaos-a" if target == "worker-a" else "chaos-b"
            armed = self.stack.fault_files[node]
            armed.write_text("CUDA error: an illegal memory access was encountered")
            # It fires at that worker's next training step; the fault is over when it has fired.
            deadline = time.monotonic() + self.args.recovery_timeout
            while armed.exists() and time.monotonic() < deadline and not self.stop_event.is_set():
                time.sleep(0.1)
            if armed.exists():
                armed.unlink(missing_ok=True)
                fault.gone = frozenset()
                log("  the device fault never fired (no job reached that worker); disarmed")
        elif kind.startswith("kill"):
            self.stack.signal(procs[target], signal.SIGKILL)
        else:
            seconds = 60.0 if kind == "long-redis-outage" else self.rng.uniform(1.0, self.args.freeze_max)
            self.stack.signal(procs[target], signal.SIGSTOP)
            log(f"  {target} frozen for {seconds:.1f} s")
            self.stop_event.wait(seconds)
            self.stack.signal(procs[target], signal.SIGCONT)
        fault.ended = time.monotonic()
        return fault

    def fault_loop(self) -> None:
        cycle: list[str] = []
        pending_long = self.args.long_redis_outage
        while not self.stop_event.is_set():
            if self.stop_event.wait(self.rng.uniform(self.args.gap_min, self.args.gap_max)):
                return
            if not cycle:
                cycle = list(self.args.kinds)
                self.rng.shuffle(cycle)
            kind = cycle.pop()
            if pending_long and len(self.faults) >= 3:
                kind, pending_long = "long-redis-outage", False
            log(f"fault #{len(self.faults) + 1}: {kind}")
            fault = self.inject(kind)
            if fault is None:  # its target is restarting: try this kind again after the others
                cycle.insert(0, kind)
                continue
            if kind == "kill-worker" and fault.target == "worker-b":
                time.sleep(1.0)
                self.stack.keep_worker_b()
            self.faults.append(fault)
            fault.recovered = wait_ready(self.client, self.args.recovery_timeout, gone=fault.gone)
            if fault.recovered is None:
                log(f"  not ready {self.args.recovery_timeout:.0f} s after {kind} on {fault.target}")
            else:
                log(f"  recovered in {fault.recovery_s:.1f} s")

