"""Data-parallel training: a job on one device against the same job on a gang of two, and how much
of a gang's step goes to communication.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/gang.py [--models cifar_net,resnet18]
        [--epochs 4] [--batch 128] [--steps 20] [--rounds 6] [--no-write-docs]

(a) Through the service, as real processes: an embedded Redis, the API and two CPU workers as two
    "hosts" (h1, h2, TORCHYARD_NODE_NAME) on this machine, each limited to one torch thread
    (OMP_NUM_THREADS=1: each "host" has one core of its own). The same job (`fake`, the given model
    and global batch, seed 0) with `world_size` 1, then 2; images/s is the worker's own per-epoch
    figure (across the gang for 2 ranks), the best epoch after the first.
(b) The step alone: two gloo processes, one thread each, run the trainer's own step
    (worker/training/train_step.StepRunner under worker/gang/collectives.GangPlacement) on the same model and
    global batch, `--steps` steps with DistributedDataParallel's gradient all-reduce and as many
    inside its `no_sync()` (everything but the all-reduce), alternating, `--rounds` rounds, the best
    of each: the communication share of a step is 1 - t(no_sync) / t(with the all-reduce). And the
    all-reduce alone: one flat tensor the size of the model's gradients, all-reduced on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.docs import write_section  # noqa: E402 (after the sys.path entry above)


def service(model: str, epochs: int, batch: int) -> dict[str, Any]:
    import httpx

    from app.embedded_redis import EmbeddedRedis
    from harness import Processes, free_port, wait_for_job, wait_until

    root = Path(tempfile.mkdtemp(prefix="torchyard-bench-gang-"))
    server = EmbeddedRedis(root / "redis")
    url = server.start()
    procs = Processes(url, root / "data", root / "logs", TORCHYARD_ADVERTISE_ADDRESS="127.0.0.1",
                      OMP_NUM_THREADS="1")
    for node in ("h1", "h2"):
        procs.worker("cpu", name=node, TORCHYARD_NODE_NAME=node)
    port = free_port()
    procs.api(port)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    rates: dict[str, Any] = {}
    try:
        wait_until(lambda: {d["id"] for d in client.get("/devices").json()["devices"] if d["status"] == "idle"}
                   >= {"h1/cpu", "h2/cpu"}, timeout=240, what="workers h1 and h2")
        for world_size in (1, 2):
            spec = {"model": model, "dataset": "fake", "epochs": epochs, "batch_size": batch, "seed": 0,
                    "patience": 0, "val_fraction": 0.1, "world_size": world_size}
            job = wait_for_job(client, client.post("/jobs", json=spec).json()["id"], {"succeeded", "failed"},
                               timeout=3600)
            assert job["status"] == "succeeded", job["error"]
            per_epoch = [m["images_per_second"] for m in job["metrics"]]
            rates[f"ws{world_size}"] = max(per_epoch[1:] or per_epoch)
            rates[f"ws{world_size}_epochs"] = per_epoch
    finally:
        client.close()
        procs.stop_all()
        server.stop()
    return rates


def _rank(rank: int, port: int, model_name: str, batch: int, steps: int, rounds: int, out: str) -> None:
    import torch
    from torch import nn

    from models.registry import build_model, get_model_spec
    from worker.data.datasets import load_fake
    from worker.gang.collectives import GangPlacement, RendezvousServer, init_group, join_store, leave_group
    from worker.training.train_step import StepRunner

    torch.set_num_threads(1)
    server = RendezvousServer("127.0.0.1", port, 60) if rank == 0 else None
    init_group(join_store(f"127.0.0.1:{port}", 60), "bench", rank, 2, torch.device("cpu"), 60)
    try:
        spec = get_model_spec(model_name)
        size = spec.input.height
        data = load_fake(spec.input.channels, size, size)
        torch.manual_seed(0)
        model = build_model(model_name, len(data.classes), spec.input.channels)
        placement = GangPlacement(rank, 2, torch.device("cpu"))
        train_model = placement.wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        runner = StepRunner(torch.device("cpu"), placement, augment=False, channels_last=False,
                            autocast=contextlib.nullcontext)
        backoff = placement.backoff(batch, "training", lambda *_: None, lambda: None)
        mean = torch.full((1, spec.input.channels, 1, 1), 0.5)
        std = torch.full((1, spec.input.channels, 1, 1), 0.25)
        gen = torch.Generator().manual_seed(0)
        loss = nn.CrossEntropyLoss()

        def run(n: int) -> None:
            for step in range(n):
                index = placement.shard(torch.arange(step * batch, (step + 1) * batch) % len(data.labels))
                runner.step(train_model, optimizer, scaler, loss, data.images[index], data.labels[index], gen, mean,
                            std, backoff)

        run(3)  # warm-up
        timings: dict[str, list[float]] = {"sync": [], "no_sync": [], "all_reduce": []}
        flat = torch.zeros(sum(p.numel() for p in model.parameters()))
        for _ in range(rounds):
            torch.distributed.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                torch.distributed.all_reduce(flat)
            timings["all_reduce"].append((time.perf_counter() - started) / steps)
            for mode in ("sync", "no_sync"):
                context = train_model.no_sync() if mode == "no_sync" else contextlib.nullcontext()  # type: ignore[operator]
                torch.distributed.barrier()
                started = time.perf_counter()
                with context:
                    run(steps)
                torch.distributed.barrier()
                timings[mode].append((time.perf_counter() - started) / steps)
        if rank == 0:
            Path(out).write_text(json.dumps(timings))
    finally:
        leave_group(failed=False)
        if server is not None:
            server.close()


def step_share(model: str, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from harness import free_port

    out = Path(tempfile.mkdtemp(prefix="torchyard-bench-step-")) / "steps.json"
    mp.spawn(_rank, args=(free_port(), model, batch, steps, rounds, str(out)), nprocs=2, join=True)
    timings = json.loads(out.read_text())
    sync, no_sync, alone = (min(timings[k]) for k in ("sync", "no_sync", "all_reduce"))
    return {"sync_ms": 1000 * sync, "no_sync_ms": 1000 * no_sync, "share": 1 - no_sync / sync,
            "all_reduce_ms": 1000 * alone,
            **{f"rounds_{k}_ms": [round(1000 * t, 1) for t in v] for k, v in timings.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cifar_net,resnet18")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128, help="the global batch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-write-docs", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = []
    for model in args.models.split(","):
        rates = service(model, args.epochs, args.batch)
        share = step_share(model, args.batch, args.steps, args.rounds)
        print(json.dumps({"model": model, **rates, **share}, indent=1), flush=True)
        rows.append(
            f"| {model} | {rates['ws1']:,.0f} | {rates['ws2']:,.0f} ({rates['ws2'] / rates['ws1']:.2f}×) | "
            f"{share['sync_ms']:.1f} / {share['no_sync_ms']:.1f} ms | **{100 * share['share']:.0f} %** | "
            f"{share['all_reduce_ms']:.1f} ms | {rates['ws1_epochs']}; {rates['ws2_epochs']} |")
    load_after = os.getloadavg()[0]
    text = (
        f"```\n.venv/bin/python bench/gang.py --models {args.models} --epochs {args.epochs} --batch {args.batch} "
        f"--steps {args.steps} --rounds {args.rounds}\n```\n\n"
        f"Host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{__import__('torch').__version__}; two CPU workers as two \"hosts\" on this one machine, one torch "
        f"thread each (one core each), gloo over loopback; `fake`, global batch {args.batch}. Load average "
        f"{load:.1f} before, {load_after:.1f} after.\n\n"
        f"| model | one device, images/s (best epoch after the first) | a gang of two, images/s (the same) | "
        f"a gang's step with / without the all-reduce | communication share of the step | the gradients' "
        f"all-reduce alone | per epoch (1; 2) |\n"
        f"| --- | ---: | ---: | ---: | ---: | ---: | --- |\n" + "\n".join(rows) + "\n\n"
    )
    if not args.no_write_docs:
        write_section("gang", "Data-parallel training (a gang of two against one device)", text)
    print(text)


if __name__ == "__main__":
    main()
