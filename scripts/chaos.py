"""Chaos soak: jobs submitted through the HTTP API while the API, the workers and Redis are killed
and frozen at random; then every acknowledged job is checked.

    make chaos                                                  # the long pass (>= 200 jobs, >= 50 faults)
    .venv/bin/python scripts/chaos.py --jobs 6 --faults 7       # a short pass (make test runs one)

The parts live in scripts/chaos_soak/ (the stack, the workload, the faults, the checks, the run);
this is the command line: its options, and the run from start to verdict.

What runs, on loopback only, in a data dir of its own (a temporary one unless --data-dir):
`torchyard up` (its embedded Redis on a unix socket, the API on 127.0.0.1, a CPU worker on node
`chaos-a`), and a second worker "host" (`chaos-b`) on the same Redis and data dir, which this
script restarts when it dies (as compose's restart policy would). Jobs train cifar_net on a small
dataset this script uploads (a few seconds of CPU each); every --gang-every'th job is data-parallel
(`world_size` 2: one rank on each host, gloo over loopback; every other one of them `elastic`), so
faults land in gangs too.

The client submits jobs one after another, each with a fresh Idempotency-Key, and retries the
same key and body on any failure (connection refused or reset, timeout, 5xx) until it is
acknowledged (202, or 200 for a retry the server had already accepted), as a careful client
would; it keeps at most --in-flight of its jobs unfinished.

Faults, one at a time, drawn from a shuffled cycle of every kind (so a short pass sees each):
kill-api, freeze-api, kill-worker, freeze-worker, kill-redis, freeze-redis, device-fault
(SIGKILL; SIGSTOP for 1..--freeze-max s then SIGCONT; the worker's CPU twin of a sticky CUDA
error). The next fault waits until the stack is whole again (/readyz answers 200 and both
workers are serving); the time from the end of a fault to that is its recovery.
--long-redis-outage adds one 60 s freeze of Redis.

Then, for every acknowledged job: it succeeded; its metrics hold epochs 1..E once each and its
event stream has one `metrics` event per epoch and one terminal status (else it "ran twice");
the checkpoint downloaded through the API hashes to the recorded sha256; and every job the
server holds was acknowledged to the client (no job nobody was told of). Prints a table and
exits 1 on any loss, double run, mismatch or unannounced job (2 if the stack never came up).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
from pathlib import Path

# The repository's root, for the stack harness (harness/) and the product it starts; chaos_soak is
# found beside this file.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from chaos_soak import log
from chaos_soak.faults import FAULT_KINDS
from chaos_soak.soak import Soak
from chaos_soak.stack import Stack


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200, help="acknowledged jobs to reach (default 200)")
    parser.add_argument("--faults", type=int, default=50, help="faults to inject (default 50)")
    parser.add_argument("--max-seconds", type=float, default=3600, help="stop submitting and injecting after this")
    parser.add_argument("--drain-seconds", type=float, default=600, help="then wait this long for jobs to end")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--images-per-class", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=4, help="unfinished jobs the client keeps at most")
    parser.add_argument("--gang-every", type=int, default=3,
                        help="every Nth job trains on both workers at once (world_size 2); 0: none")
    parser.add_argument("--gap-min", type=float, default=1.0, help="seconds between a recovery and the next fault")
    parser.add_argument("--gap-max", type=float, default=5.0)
    parser.add_argument("--freeze-max", type=float, default=8.0, help="longest SIGSTOP, seconds")
    parser.add_argument("--kinds", default=",".join(FAULT_KINDS),
                        help=f"comma-separated fault kinds to draw from (default: all of {', '.join(FAULT_KINDS)})")
    parser.add_argument("--long-redis-outage", action="store_true", help="also freeze Redis once for 60 s")
    parser.add_argument("--lease-ttl", type=float, default=3.0)
    parser.add_argument("--recovery-timeout", type=float, default=120.0)
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--data-dir", type=Path, default=None, help="default: a temporary directory, removed after")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    args.kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = set(args.kinds) - set(FAULT_KINDS)
    if unknown or not args.kinds:
        parser.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(FAULT_KINDS)}")
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    return args


def _stop_on_sigterm(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # stop the stack we started, then exit
    own_dir = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="torchyard-chaos-")) if own_dir else args.data_dir
    log(f"seed {args.seed}; data dir {data_dir}; targets: {args.jobs} jobs, {args.faults} faults, "
        f"at most {args.max_seconds:.0f} s")
    stack = Stack(data_dir, args.lease_ttl)
    soak = Soak(args, stack)
    try:
        stack.start()
        if stack.wait_for_redis(60):  # the second host starts as soon as there is a Redis to join
            stack.start_worker_b()
            stack.supervise_worker_b()
        if soak.wait_ready(240) is None:
            log("the stack did not become ready; see the logs in " + str(stack.logs))
            return 2
        report = soak.run()
    finally:
        stack.stop()
        soak.close()
    print(report.table(), flush=True)
    if args.json:
        args.json.write_text(json.dumps({**report.as_dict(), "seed": args.seed}, indent=2))
    if own_dir and report.ok:
        shutil.rmtree(data_dir, ignore_errors=True)
    elif not report.ok:
        log(f"logs kept in {stack.logs}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
