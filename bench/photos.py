"""Photos end to end on whatever host this is: upload, first and second training job, /predict, and
in the same run the floors they are read against and LitServe serving the same checkpoint.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/photos.py [--write-docs]   # or make bench-gpu
    scripts/gpu-bench.sh [--write-docs]                                              # a GPU host

On a GPU host (torch sees CUDA): resnet18 at image_size 224, 3,000 photos, 3 epochs, cells of 3 s;
on a CPU-only host: cifar_net at its 32×32 (`--models cifar_net,resnet18@64` adds resnet18 at 64×64,
a longer run), 300 photos, 2 epochs. In order:
  1. photo-like JPEGs, 500×375, ~38 KB (bench/photo_data.py, a fixed seed), in 10 class folders;
  2. floors, nothing of ours running: the raw forward at batch 1 and 32 (bench/floors.py: fresh
     processes, best of torch threads × precision fp32/bf16 where the hardware runs bf16 natively ×
     eager or traced), and the decode ceiling: Pillow decode + resize of the /predict JPEG to the
     model's input in as many fresh processes as cores (and in one: the one-core decode), best of
     with and without `Image.draft`;
  3. `python -m app.cli up` on a data dir of its own (embedded Redis, the API with its default
     processes, one worker: the first GPU, or the CPU): POST /datasets of the zip, then per model a
     training job on it and the same job again (the set then decoded), read from the job's events
     (epoch seconds, event times), then POST /predict of one JPEG at 1, 32 and 128 clients;
  4. the stack stopped: a tight training loop with the job's batch, optimizer and precision on
     resident data (the steady epoch's floor), and LitServe serving the job's checkpoint with its
     own decode, best of its documented configurations (bench/peers.py), at the same concurrencies.
Prints one table; `--write-docs` replaces this host's section of docs/benchmarks.md ("Photos on a
GPU host" or "Photos on this CPU host"); `--json FILE` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/photos.py`: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import photo_report
from bench.floors import decode_ceiling, forward_floor, make_checkpoint, train_floor
from bench.harness import cpu_has_bf16, load, load_average, multipart_request
from bench.peers import LITSERVE_CONFIGS, litserve_missing, litserve_sweep
from bench.photo_data import sample_jpeg as make_sample
from bench.photo_data import write_dataset_zip
from bench.stack import JOB_TIMEOUT_S
from harness import UpStack

BATCHES = [1, 32]


def host_defaults(cuda: bool, tiny: bool) -> dict[str, Any]:
    if tiny:  # CI: every stage once, as fast as it goes (tests/bench/test_photos.py)
        return {"models": ["cifar_net"], "photos": 20, "epochs": 1, "seconds": 1.0, "warmup": 0.3,
                "floor_seconds": 0.2, "decode_seconds": 0.5, "concurrency": [1, 32, 128], "litserve": "one"}
    if cuda:
        return {"models": ["resnet18@224"], "photos": 3000, "epochs": 3, "seconds": 3.0, "warmup": 1.0,
                "floor_seconds": 1.0, "decode_seconds": 2.0, "concurrency": [1, 32, 128], "litserve": "all"}
    # resnet18@64 (--models cifar_net,resnet18@64) doubles a CPU run: its floors, jobs and LitServe's
    # sweep at 128 clients, whose answers take seconds on 2 cores.
    return {"models": ["cifar_net"], "photos": 300, "epochs": 2, "seconds": 3.0, "warmup": 1.0,
            "floor_seconds": 1.0, "decode_seconds": 2.0, "concurrency": [1, 32, 128], "litserve": "all"}


def model_size(entry: str) -> tuple[str, int]:
    """"resnet18@224" → ("resnet18", 224); "cifar_net" → its fixed input size."""
    from models.registry import get_model_spec

    name, _, size = entry.partition("@")
    spec = get_model_spec(name).input
    if size and spec.fixed_size:
        raise SystemExit(f"{name} has a fixed input size ({spec.height}×{spec.width}): no @size")
    return name, int(size) if size else spec.height


def precisions(device: str) -> tuple[str, ...]:
    """fp32, and bf16 where the hardware runs it natively: CUDA capability 8.0 and newer, or a CPU
    with AVX512-BF16/AMX (worker/training/recipe.py decides a job's precision by the same rule on CUDA)."""
    import torch

    if device == "cuda":
        return ("fp32", "bf16") if torch.cuda.get_device_capability(0) >= (8, 0) else ("fp32",)
    return ("fp32", "bf16") if cpu_has_bf16() else ("fp32",)


def litserve_configs(scope: str, cuda: bool, cores: int) -> list[dict[str, Any]]:
    """On a CPU host bench/predict.py's sweep. On a GPU host, where each configuration starts CUDA
    in every worker and the run must stay under 6 minutes: `fast_queue` on (LitServe's advice for
    throughput), batching on and off, and 1 or a quarter of the cores' worth of workers on the GPU
    (LitServe decodes in its inference workers, so more workers decode on more cores)."""
    if scope == "one":
        return [{"fast_queue": False, "workers_per_device": 1, "batching": True}]
    if cuda:
        return [{"fast_queue": True, "workers_per_device": w, "batching": b}
                for w in (1, max(2, cores // 4)) for b in (True, False)]
    return LITSERVE_CONFIGS


def gpu_index() -> str:
    """The GPU `up` is given: the first one this process may see."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible if visible and visible != "-1" else "0"


# ----------------------------------------------------------------------------- a job, from its events
def follow_job(client: Any, job_id: str) -> list[dict[str, Any]]:
    """The job's events until its terminal status, each with the Redis time it was recorded at
    (its stream id's milliseconds): {"t", "event", "data"}."""
    import httpx

    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    timeout = httpx.Timeout(60, read=JOB_TIMEOUT_S)
    with client.stream("GET", f"/jobs/{job_id}/events", timeout=timeout) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("id:"):
                current["t"] = int(line[3:].strip().split("-")[0]) / 1e3
            elif line.startswith("event:"):
                current["event"] = line[6:].strip()
            elif line.startswith("data:"):
                current["data"] = json.loads(line[5:].strip())
            elif line == "" and "event" in current:
                events.append(current)
                current = {}
                last = events[-1]
                if last["event"] == "status" and last["data"].get("status") in ("succeeded", "failed", "cancelled"):
                    break
    return events


def timeline(events: list[dict[str, Any]], job: dict[str, Any]) -> dict[str, Any]:
    """Wall time from the queued event to the terminal one; inside the epochs (their own seconds)
    and outside them, split into: until epoch 1's record (dispatch, loading and decoding the data,
    setting up, and epoch 1's validation and resume checkpoint), between later epochs (validation,
    resume checkpoints), and after the last epoch's record (the final checkpoint, the record)."""
    status = [e for e in events if e["event"] == "status"]
    epochs = [e for e in events if e["event"] == "metrics"]
    start, end = status[0]["t"], status[-1]["t"]
    running = next((e["t"] for e in status if e["data"].get("status") == "running"), start)
    inside = sum(m["seconds"] for m in job["metrics"])
    until_first = epochs[0]["t"] - start - epochs[0]["data"]["seconds"] if epochs else end - start
    between = sum(epochs[k]["t"] - epochs[k - 1]["t"] - epochs[k]["data"]["seconds"] for k in range(1, len(epochs)))
    return {"wall_s": end - start, "inside_s": inside, "outside_s": end - start - inside, "queued_s": running - start,
            "until_first_s": until_first, "between_s": between, "after_last_s": end - epochs[-1]["t"] if epochs else 0.0,
            "epochs": [m["images_per_second"] for m in job["metrics"]], "epoch_seconds": [m["seconds"] for m in job["metrics"]]}


def train_job(client: Any, spec: dict[str, Any]) -> dict[str, Any]:
    created = client.post("/jobs", json=spec)
    if created.status_code >= 300:
        raise RuntimeError(f"POST /jobs {spec}: {created.status_code} {created.text}")
    job_id = created.json()["id"]
    events = follow_job(client, job_id)
    job = client.get(f"/jobs/{job_id}").json()
    if job["status"] != "succeeded":
        raise RuntimeError(f"job {job_id} {job['status']}: {job.get('error')}")
    return {"id": job_id, "params": {**job["params"], **(job.get("device_choices") or {})}, "device": job["device"], **timeline(events, job)}


# ----------------------------------------------------------------------------- the run
def say(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}", flush=True)


def keep_so_far(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The figures measured so far, to --json: a run cut short (a lent GPU host's time is counted)
    still leaves them."""
    if args.json:
        args.json.write_text(json.dumps({"results": results, "partial": True}, default=str))


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from core.datasets import split_sizes

    cuda = args.host == "cuda"
    device = "cuda" if cuda else "cpu"
    cores = os.cpu_count() or 1
    models = dict(model_size(m) for m in args.models)
    results: dict[str, Any] = {"host": args.host, "args": {k: v for k, v in vars(args).items() if k != "func"},
                               "load_start": load_average(), "models": {}, "cores": cores, "torch": torch.__version__}
    t0 = time.perf_counter()
    say(f"[photos] {args.photos} photos ...")
    results["dataset"] = write_dataset_zip(work / "photos.zip", args.photos)
    sample = make_sample()
    (work / "sample.jpg").write_bytes(sample)
    results["sample_bytes"] = len(sample)

    # The floor's settings: threads (on a GPU, whatever torch chose) × the precisions the hardware runs.
    # --tiny: one fresh process for each floor, it checks the plumbing, not the speed.
    settings = [(cores, "default")] if cuda or args.tiny else [(t, "default") for t in sorted({1, cores})]
    floor_precisions = ("fp32",) if args.tiny else precisions(device)
    for name, size in models.items():
        say(f"[{name}@{size}] floors: forward, decode ...")
        _, checkpoint = make_checkpoint(work / "floor", name, size)
        r: dict[str, Any] = {"size": size}
        results["models"][name] = r
        r["forward"] = forward_floor(checkpoint, BATCHES, args.floor_seconds, settings, device, floor_precisions)
        r["decode_all"] = decode_ceiling(work / "sample.jpg", size, size, args.decode_seconds, cores)
        r["decode_one"] = decode_ceiling(work / "sample.jpg", size, size, args.decode_seconds, 1)
        keep_so_far(args, results)

    env = {"TORCHYARD_DEVICES": gpu_index() if cuda else "cpu"}
    with UpStack(work / "data", work / "logs" / "up.log", env) as stack:
        say(f"[stack] up on :{stack.port}, POST /datasets ...")
        began = time.perf_counter()
        with (work / "photos.zip").open("rb") as archive:
            uploaded = stack.client.post("/datasets", files={"file": ("photos.zip", archive, "application/zip")},
                                         data={"name": "bench-photos"})
        if uploaded.status_code != 201:
            raise RuntimeError(f"POST /datasets: {uploaded.status_code} {uploaded.text[:500]}")
        results["upload"] = {"seconds": time.perf_counter() - began, **uploaded.json()}
        results["upload"].pop("skipped", None)
        pids = stack.pids()
        for name, size in models.items():
            r = results["models"][name]
            spec: dict[str, Any] = {"model": name, "dataset": uploaded.json()["id"], "epochs": args.epochs, "device": device}
            if not model_fixed(name):
                spec["image_size"] = size
            for key in ("job1", "job2"):
                say(f"[{name}@{size}] {key} ...")
                r[key] = train_job(stack.client, spec)
                keep_so_far(args, results)
            request = multipart_request(stack.port, "/predict", sample, {"job_id": r["job1"]["id"], "top_k": "5"},
                                        "photo.jpg", "image/jpeg")
            r["predict"] = {}
            stack.close_connections()
            for c in args.concurrency:
                say(f"[{name}@{size}] /predict c={c} ...")
                r["predict"][c] = load(stack.port, request, c, args.seconds, pids, warmup=args.warmup)
                keep_so_far(args, results)
            ckpt = stack.client.get(f"/jobs/{r['job1']['id']}/checkpoint")
            ckpt.raise_for_status()
            (work / f"{name}.pt").write_bytes(ckpt.content)

    for name, size in models.items():
        r = results["models"][name]
        p = r["job1"]["params"]
        say(f"[{name}@{size}] floor: tight training loop ...")
        images, _ = split_sizes(results["upload"]["num_images"], p["val_fraction"])  # the job's training images
        r["train_floor"] = train_floor({"model": name, "device": device, "image_size": size, "images": images,
                                        "batch_size": p["batch_size"], "optimizer": p["optimizer"],
                                        "learning_rate": p["learning_rate"], "amp_dtype": p.get("amp_dtype"),
                                        "channels_last": p.get("channels_last", False),
                                        "epochs": max(3, args.epochs + 1)},
                                       [cores] if cuda or args.tiny else sorted({1, cores}))
        keep_so_far(args, results)
    missing = litserve_missing()
    results["litserve_note"] = "LitServe skipped (--litserve skip)" if args.litserve == "skip" else missing
    if results["litserve_note"] is None:
        configs = litserve_configs(args.litserve, cuda, cores)
        results["litserve_configs"] = len(configs)
        for name, size in models.items():
            say(f"[{name}@{size}] LitServe, {len(configs)} configurations ...")
            results["models"][name]["litserve"] = litserve_sweep(
                work / f"{name}.pt", sample, args.concurrency, args.seconds, work / "logs", configs, "photo.jpg",
                "image/jpeg", device, "fp32", args.warmup, f"-{name}")
    results["seconds"] = time.perf_counter() - t0
    results["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results["load_end"] = load_average()
    return results


def model_fixed(name: str) -> bool:
    from models.registry import get_model_spec

    return get_model_spec(name).input.fixed_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--tiny", action="store_true", help="CI: a handful of photos, 1 epoch, 1-second cells")
    parser.add_argument("--models", type=lambda s: s.split(","), help="model[@image_size],...")
    parser.add_argument("--photos", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--seconds", type=float, help="measured seconds per /predict cell")
    parser.add_argument("--warmup", type=float, help="seconds of load before each cell's window")
    parser.add_argument("--floor-seconds", type=float, help="seconds per forward floor measurement")
    parser.add_argument("--decode-seconds", type=float, help="seconds per decode ceiling measurement")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--litserve", choices=("all", "one", "skip"),
                        help="LitServe's configurations: this host's sweep (all), one, none")
    parser.add_argument("--write-docs", action="store_true", help="replace this host's section of docs/benchmarks.md")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, data)")
    args = parser.parse_args(argv)
    import torch

    args.host = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    for key, value in host_defaults(args.host == "cuda", args.tiny).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    work = Path(tempfile.mkdtemp(prefix="torchyard-bench-photos-"))
    say(f"[photos] {args.host} host, work dir {work}")
    try:
        results = run(args, work)
    except BaseException:
        print(f"[photos] failed; logs under {work / 'logs'}", file=sys.stderr, flush=True)
        args.keep = True
        raise
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    shown = list(sys.argv[1:] if argv is None else argv)
    if "--json" in shown:  # where this run's figures went is no part of the command to repeat it
        del shown[shown.index("--json"):shown.index("--json") + 2]
    report = photo_report.build(results, " ".join(shown))
    print(report.text)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "rows": report.rows, "goals": report.goals}, default=str))
    if args.write_docs:
        photo_report.write_docs(results, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
