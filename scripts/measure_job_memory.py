"""Calibrate core/admission.py: the peak memory of the real worker code against the estimate.

Each measurement runs in a fresh process: it imports what a worker imports, builds its inputs,
settles (gc, malloc_trim) and records its RSS, resets the kernel's peak-RSS counter (VmHWM), then
runs one phase of a job with the code a worker runs, and reports the peak RSS above that baseline, the larger of two runs:

- `train`: worker/training/trainer.Trainer for one epoch on N random uint8 images (the split copies, the
  channel statistics, forward/backward, evaluation); compared with the estimate's host bytes
  without the runtime and without the N·E dataset already resident at the baseline;
- `fake`: worker/data/datasets.load_fake (the float temporaries of the synthetic set); compared with the
  estimate's preparation term.

    .venv/bin/python scripts/measure_job_memory.py            # the table in docs/security.md
    .venv/bin/python scripts/measure_job_memory.py --quick    # two configurations

CPU only (the GPU terms are not measured here). Uses one torch thread; each configuration runs a
few seconds on a small host.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

TRAIN_CONFIGS = [  # model, channels, size, images, batch
    ("cifar_net", 3, 32, 2560, 128),
    ("catdog_net", 1, 50, 2560, 128),
    ("resnet18", 3, 32, 2560, 256),
    ("resnet18", 3, 128, 512, 32),
    ("mobilenet_v3_small", 3, 96, 1024, 64),
]
FAKE_CONFIGS = [(3, 64), (3, 128)]

CHILD = r"""
import json, resource, sys, pathlib
import psutil, torch
torch.set_num_threads(1)
from worker.data.datasets import ImageTensors, load_fake
from worker.data.normalization import channel_stats, stats_tensors
from worker.training.trainer import Trainer, plan_training
from worker.checkpoints.format import Preprocessing
from core.kinds.train import resolve_params
from core.kinds.train import JobSpec
from models.registry import build_model
phase, args = sys.argv[1], json.loads(sys.argv[2])

def peak_rss():
    # VmHWM: the peak since settled_rss() reset it (Linux clear_refs 5), not the process's lifetime.
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def settled_rss():
    # The baseline without freed heap (glibc keeps it, and the phase would reuse it unseen), and the
    # peak counter reset to it.
    import ctypes, gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return psutil.Process().memory_info().rss

class Quiet:
    def progress(self, *a): pass
    def epoch(self, *a): pass
    def resumed(self, *a): pass

def trainer(model, channels, size, n, batch, val_fraction, workdir):
    images = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8)
    data = ImageTensors(images, torch.arange(n) % 10, [f"c{k}" for k in range(10)])
    fixed = model in ("cifar_net", "catdog_net")
    spec = JobSpec(model=model, dataset="fake", epochs=1, batch_size=batch, val_fraction=val_fraction,
                   image_size=None if fixed else size)
    plan = plan_training("calib", model, resolve_params(spec), data, torch.device("cpu"), channels, size, size)
    return Trainer(plan, data, final_path=pathlib.Path(workdir) / "m.pt", resume_path=pathlib.Path(workdir) / "r.pt",
                   reporter=Quiet(), should_stop=lambda: None)

if phase == "fake":
    channels, size = args
    base = settled_rss()
    load_fake(channels, size, size)
elif phase == "stats":
    channels, size, n = args
    images = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8)
    base = settled_rss()
    channel_stats(images)
elif phase == "step":  # one training step on `batch` images (no validation), the model and optimizer
    model, channels, size, batch, workdir = args
    run = trainer(model, channels, size, batch, batch, 0.0, workdir)
    base = settled_rss()
    run.run()
elif phase == "eval":  # an evaluation pass in batches of max(batch, 256), as the trainer does
    model, channels, size, n, batch, workdir = args
    run = trainer(model, channels, size, n, batch, 0.0, workdir)
    net = build_model(model, 10, channels)
    pre = Preprocessing(channels, size, size, (0.5,) * channels, (0.25,) * channels)
    mean, std = stats_tensors(pre, "cpu")
    base = settled_rss()
    run._evaluate(net, run.data.images, run.data.labels, mean, std, run.data.classes)
else:  # a whole job: split, statistics, an epoch, evaluation
    model, channels, size, n, batch, workdir = args
    run = trainer(model, channels, size, n, batch, 0.1, workdir)
    base = settled_rss()
    run.run()
print(json.dumps({"baseline": base, "peak": peak_rss()}))
"""


# The same phase peaks differently from run to run, from the allocators' choices (docs/security.md,
# "Job admission", has an example): the larger one is what a host must hold.
REPEATS = 2


def run(phase: str, args: list) -> dict:
    peaks = []
    for _ in range(REPEATS):
        out = subprocess.run([sys.executable, "-c", CHILD, phase, json.dumps(args)], cwd=REPO, capture_output=True,
                             text=True, check=True)
        peaks.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return max(peaks, key=lambda p: p["peak"] - p["baseline"])


def main() -> None:
    import tempfile

    sys.path.insert(0, str(REPO))
    from core import admission as a
    from core.datasets import DatasetRecord
    from core.kinds.train.params import validation_batch
    from models.registry import MODELS

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    mib = 1024**2

    def row(phase: str, config: str, got: dict, predicted: float) -> None:
        measured = got["peak"] - got["baseline"]
        print(f"| {phase} | {config} | {measured / mib:.0f} MiB | {predicted / mib:.0f} MiB | "
              f"{predicted / max(measured, 1):.2f} |", flush=True)

    print("| phase | configuration | measured peak above baseline | estimate | estimate / measured |")
    print("|---|---|---|---|---|")
    for model, channels, size, n, batch in TRAIN_CONFIGS[:2] if quick else TRAIN_CONFIGS:
        values = channels * size * size
        acts = a.activation_bytes_per_image(MODELS[model], size, size)
        with tempfile.TemporaryDirectory() as workdir:
            step = run("step", [model, channels, size, batch, workdir])
            evaluation = run("eval", [model, channels, size, n, batch, workdir])
            job = run("job", [model, channels, size, n, batch, workdir])
        params = MODELS[model].parameters * (8 + a.OPTIMIZER_STATE_BYTES["adam"])
        row("step", f"{model} {channels}×{size}×{size}, batch {batch}", step,
            a.JOB_OVERHEAD_BYTES + params + batch * (a.ACTIVATION_FACTOR * acts + a.INPUT_COPIES * 4 * values))
        row("eval", f"{model} {channels}×{size}×{size}, {n} images", evaluation,
            a.JOB_OVERHEAD_BYTES + min(n, validation_batch(batch)) * a.EVAL_FACTOR * acts)
        record = DatasetRecord(id="u", name="u", kind="upload", num_images=n)
        need = a.estimate(a.JobShape(MODELS[model], record, channels, size, batch, "adam", 0.1), "cpu")
        # The baseline already holds the runtime and the N·E dataset; the estimate counts both.
        row("job", f"{model} {channels}×{size}×{size}, N={n}, batch {batch}", job,
            need.host_bytes - a.RUNTIME_BYTES - n * values)
    for channels, size, n in [(3, 64, 20000)] if not quick else []:
        row("stats", f"{n}×{channels}×{size}×{size}", run("stats", [channels, size, n]),
            a.STATS_BYTES_PER_VALUE * n * channels * size * size)
    for channels, size in FAKE_CONFIGS[:1] if quick else FAKE_CONFIGS:
        row("fake", f"2560×{channels}×{size}×{size}", run("fake", [channels, size]),
            a.FAKE_PREP_BYTES_PER_VALUE * 2560 * channels * size * size)


if __name__ == "__main__":
    main()
