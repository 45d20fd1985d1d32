"""A CPU's training and forward speed in fp32 and under bf16 autocast, and what bf16 does to accuracy.

    .venv/bin/python bench/cpu_precision.py [--rounds 3] [--seconds 4] [--cells all] [--accuracy]

Speed: each cell (model, what, image size, batch, dtype, memory format) runs in a fresh process
with torch's default threads (or --threads): a tight loop on resident random data, after two
untimed iterations, for --seconds (at least 3 iterations); the cell's figures are its fastest
iteration in images/s of wall time and in images per CPU-second of the process (with one
thread the latter hardly moves with what else the host runs; with more, OpenMP's spinning
counts too). Rounds alternate the cells, so a shared host's slow minutes fall on both dtypes;
the summary gives each cell's best and its range over the rounds.

- train: normalise the uint8 batch, forward, cross-entropy, backward, AdamW step (the trainer's
  step without augmentation);
- forward: eval mode, inference_mode, normalise + forward.

Accuracy (--accuracy): the worker's own Trainer on the built-in `fake` set (2,560 images, 10 %
held out: the default), the same seed, fp32 in NCHW against bf16 autocast in channels_last (what
worker/training/recipe.choose_precision picks for a CPU with native bf16): the kept weights' validation
accuracy and loss of each.

The CPU's flags (avx512_bf16, amx_bf16) are printed with the results: they are what
worker/training/recipe.choose_precision decides by.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# (model, what, image size, batch)
CELLS = [("cifar_net", "train", 32, 128), ("resnet18", "train", 32, 128), ("resnet18", "forward", 32, 128),
         ("resnet18", "train", 224, 16), ("resnet18", "forward", 224, 32)]
VARIANTS = [("fp32", "nchw"), ("bf16", "nchw"), ("fp32", "channels_last"), ("bf16", "channels_last")]

CHILD = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from models.registry import build_model
model_name, what, size, batch, dtype, layout, seconds, threads = sys.argv[2:10]
size, batch, seconds = int(size), int(batch), float(seconds)
if int(threads):
    torch.set_num_threads(int(threads))
torch.manual_seed(0)
model = build_model(model_name, 10, 3)
images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
labels = torch.randint(0, 10, (batch,))
mean = torch.full((1, 3, 1, 1), 0.5); std = torch.full((1, 3, 1, 1), 0.25)
channels_last = layout == "channels_last"
if channels_last:
    model = model.to(memory_format=torch.channels_last)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = torch.nn.CrossEntropyLoss()
amp = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else None

def one():
    x = (images.float().div_(255.0) - mean) / std
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    if what == "train":
        optimizer.zero_grad(set_to_none=True)
        if amp is not None:
            with amp:
                logits = model(x)
        else:
            logits = model(x)
        loss_fn(logits.float(), labels).backward()
        optimizer.step()
    else:
        with torch.inference_mode():
            if amp is not None:
                with amp:
                    model(x)
            else:
                model(x)

if what == "forward":
    model.eval()
for _ in range(2):
    one()
wall, cpu, start = [], [], time.perf_counter()
while time.perf_counter() - start < seconds or len(wall) < 3:
    began, began_cpu = time.perf_counter(), time.process_time()
    one()
    wall.append(time.perf_counter() - began)
    cpu.append(time.process_time() - began_cpu)
print(json.dumps({"images_per_second": round(batch / min(wall), 1),
                  "images_per_cpu_second": round(batch / min(cpu), 1), "threads": torch.get_num_threads()}))
'''


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if "bf16" in f or f.startswith("amx"))
    except OSError:
        pass
    return []


def speed(rounds: int, seconds: float, cells: list[tuple], threads: int) -> None:
    results: dict[str, list[float]] = {}
    per_cpu: dict[str, list[float]] = {}
    for round_ in range(rounds):
        for cell in cells:
            for dtype, layout in VARIANTS:
                key = " ".join(map(str, (*cell, dtype, layout)))
                out = subprocess.run([sys.executable, "-c", CHILD, str(REPO), *map(str, cell), dtype, layout,
                                      str(seconds), str(threads)], capture_output=True, text=True, check=True)
                measured = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault(key, []).append(measured["images_per_second"])
                per_cpu.setdefault(key, []).append(measured["images_per_cpu_second"])
                print(json.dumps({"round": round_ + 1, "cell": key, **measured}), flush=True)
    print(json.dumps({"wall_best_min_max": {k: [max(v), min(v), max(v)] for k, v in results.items()},
                      "cpu_best_min_max": {k: [max(v), min(v), max(v)] for k, v in per_cpu.items()}}), flush=True)


def accuracy(epochs: int) -> None:
    import tempfile

    import torch

    from core.kinds.train import JobSpec, resolve_params
    from worker.data.datasets import load_fake
    from worker.training.trainer import Trainer, plan_training

    class Quiet:
        def progress(self, *_: object) -> None: ...
        def resumed(self, *_: object) -> None: ...
        def notice(self, *_: object) -> None: ...
        def epoch(self, *_: object) -> None: ...

    data = load_fake(3, 32, 32, seed=0)
    for model in ("cifar_net", "resnet18"):
        for amp, channels_last in ((None, False), ("bfloat16", True)):
            params = resolve_params(JobSpec(model=model, dataset="fake", epochs=epochs, seed=0))
            plan = plan_training("bench", model, params, data, torch.device("cpu"), 3, 32, 32).with_choices(
                amp_dtype=amp, channels_last=channels_last)
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp)

                def resume_to(epoch: int, folder: Path = folder) -> Path:
                    return folder / f"r{epoch}.pt"

                result = Trainer(plan, data, final_path=folder / "m.pt", resume_from=None, resume_to=resume_to,
                                 reporter=Quiet(), should_stop=lambda: None).run()
            assert result.validation is not None
            print(json.dumps({"model": model, "amp_dtype": amp, "channels_last": channels_last, "epochs": epochs,
                              "val_accuracy": result.validation.accuracy, "val_loss": result.validation.loss,
                              "kept_epoch": result.best_epoch}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--cells", default="all", help="indices into CELLS, e.g. 0,3 (default: all)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per cell (0: torch's default)")
    parser.add_argument("--accuracy", action="store_true", help="the accuracy comparison instead of speed")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps({"cpu_flags": cpu_flags(), "cores": len(os.sched_getaffinity(0)),
                      "load_average": os.getloadavg()[0]}), flush=True)
    if args.accuracy:
        accuracy(args.epochs)
    else:
        cells = CELLS if args.cells == "all" else [CELLS[int(i)] for i in args.cells.split(",")]
        speed(args.rounds, args.seconds, cells, args.threads)
    print(json.dumps({"load_average_end": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
