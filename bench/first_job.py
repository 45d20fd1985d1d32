"""Where a worker's first job on a fresh photo set spends the seconds outside its epochs, phase by phase,
against the same job on the decoded set (docs/benchmarks.md, "A first job's fixed cost").

    python -m bench.first_job --photos 600 [--model mobilenet_v3_small] [--idle 5] [--device cuda] [--decode auto]

Run as a module, like the worker (`python -m app.cli worker`): multiprocessing makes every decoding
process import the main module, and this one imports what app/cli.py imports (torch only inside
main()), so the pool's start costs what it costs in a worker. In one process: the worker's start
(what worker/runtime/main.py prepares beside it, where that exists), `--idle` seconds (the upload), then
job 1 on a fresh copy of the set and job 2 on the same set, each from load_image_folder to the first
training step of epoch 1 (the trainer's set-up on this host's CPU; the epochs themselves are not
run). The phases are timed by wrapping the functions that run them, so the same script times an
older tree (PYTHONPATH=<its checkout>) as well. `--device`/`--decode` are the worker's device and
TORCHYARD_DECODE: on a CUDA device the first decode sends the baseline JPEGs to nvJPEG
(worker/data/device_dataset_decode.py), and job 1's line says how many files each decoder took.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import app.cli  # noqa: F401  (the worker's main module's imports: what each decoding process finds)

MARKS: list[tuple[float, str]] = []


def mark(what: str) -> None:
    MARKS.append((time.perf_counter(), what))


def timed(module: Any, name: str, label: str) -> None:
    """Mark the start and end of every call of module.name."""
    original = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(f"{label} begins [{threading.current_thread().name}]")
        try:
            return original(*args, **kwargs)
        finally:
            mark(f"{label} ends [{threading.current_thread().name}]")

    setattr(module, name, wrapper)


def instrument() -> None:
    import torch

    import worker.data.dataset_decode as decode
    import worker.data.datasets as data
    import worker.training.trainer as trainer

    pool: Callable[..., Any] = decode._pool

    @contextmanager
    def timed_pool(workers: int, nice: int) -> Iterator[Any]:
        mark(f"pool of {workers} processes starts")
        with pool(workers, nice) as executor:
            submit, started = executor.submit, list[bool]()

            def first_submit(*args: Any, **kwargs: Any) -> Any:
                future = submit(*args, **kwargs)
                if not started:
                    started.append(True)
                    mark("its processes started (first submit returned)")
                return future

            executor.submit = first_submit
            yield executor
            mark("last chunk decoded")
        mark("pool shut down")

    decode._pool = timed_pool
    timed(torch, "save", "torch.save")
    timed(data, "_read_cache", "cache read")
    timed(trainer, "channel_stats", "trainer: channel statistics")
    timed(trainer, "build_model", "trainer: model built (imports included)")


def run(photos: Path, model: str, device: str, decode: str) -> None:
    import torch

    import worker.data.datasets as data
    import worker.training.trainer as trainer
    try:
        from core.kinds.train import JobSpec, resolve_params
    except ImportError:  # an older tree (bench/first_job.py runs against one for the "before" figures)
        from core.params import resolve_params  # type: ignore[import-not-found,import-untyped,no-redef,unused-ignore]
        from core.schemas import JobSpec  # type: ignore[attr-defined,no-redef]
    from worker.runtime.job_context import StopJob

    class Reporter:
        def progress(self, *_: Any) -> None: ...
        def epoch(self, *_: Any, **__: Any) -> None: ...
        def resumed(self, *_: Any) -> None: ...
        def notice(self, *_: Any) -> None: ...

    def first_step() -> str:
        mark("epoch 1's first step")
        return "stop"

    device_decode = None
    try:
        from core.config import Settings
        from worker.data.device_dataset_decode import DeviceDecode
        device_decode = DeviceDecode.chosen(Settings(decode=decode), device)
    except ImportError:  # an older tree: the pool alone
        pass
    work = Path(tempfile.mkdtemp(prefix="torchyard-first-job-"))
    try:
        root = work / "set"
        shutil.copytree(photos, root)
        os.sync()
        for job in ("job 1 (fresh set)", "job 2 (decoded set)"):
            MARKS.clear()
            mark(f"{job}: starts")
            if device_decode is not None:
                images = data.load_image_folder(root, 3, 224, 224, device_decode=device_decode)
            else:
                images = data.load_image_folder(root, 3, 224, 224)
            mark("data in hand (load_image_folder returned)")
            report = getattr(images, "report", None)
            if report is not None and device_decode is not None:
                print(f"{job}: decoded {report.on_device} files by nvJPEG on {device_decode.device} "
                      f"({len(report.device_batches)} calls), {report.on_cpu} by the decoding processes")
            elif report is not None:
                print(f"{job}: decoded {report.on_cpu} files by the decoding processes alone (device {device}, "
                      f"TORCHYARD_DECODE={decode})")
            elif "fresh" in job:
                print(f"{job}: decoded by the decoding processes (an older tree: no report)")
            params = resolve_params(JobSpec(model=model, dataset="bench", epochs=1, image_size=224))
            plan = trainer.plan_training("bench", model, params, images, torch.device(device), 3, 224, 224)
            with_stop = trainer.Trainer(plan, images, final_path=work / "model.pt", resume_from=None,
                                        resume_to=lambda epoch: work / f"resume-{epoch}.pt", reporter=Reporter(),
                                        should_stop=first_step)
            try:
                with_stop.run()
            except StopJob:
                pass
            if hasattr(data, "CacheWriter"):
                data.CacheWriter.wait()
            t0 = MARKS[0][0]
            for t, what in sorted(MARKS):
                print(f"{t - t0:8.3f} s  {what}")
            outside = next(t for t, what in MARKS if what.startswith("epoch 1")) - t0
            print(f"{job}: {outside:.2f} s until epoch 1's first step\n", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=600)
    parser.add_argument("--model", default="mobilenet_v3_small", help="trained at 224 (the cheapest model at 224)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds between the worker's start and job 1")
    parser.add_argument("--device", default="cpu", help="the worker's torch device (cuda: a GPU worker's first decode)")
    parser.add_argument("--decode", default="auto", choices=("auto", "cpu", "cuda"), help="TORCHYARD_DECODE")
    args = parser.parse_args()
    began = time.perf_counter()
    import torch  # noqa: F401  (a worker has it before its first job)

    try:
        from worker.runtime.main import _prepare_for_jobs  # what the worker starts beside its start (newer trees)
        threading.Thread(target=_prepare_for_jobs, daemon=True).start()
        prepared = "the worker's preparation started"
    except ImportError:
        prepared = "nothing prepared (an older tree)"
    print(f"worker start: torch imported in {time.perf_counter() - began:.2f} s; {prepared}; idle {args.idle} s")
    instrument()
    from bench.photo_data import write_dataset_zip

    with tempfile.TemporaryDirectory(prefix="torchyard-photos-") as tmp:
        write_dataset_zip(Path(tmp) / "photos.zip", args.photos)
        with zipfile.ZipFile(Path(tmp) / "photos.zip") as archive:
            archive.extractall(Path(tmp) / "photos")
        time.sleep(max(0.0, args.idle - (time.perf_counter() - began)))
        run(Path(tmp) / "photos", args.model, args.device, args.decode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
