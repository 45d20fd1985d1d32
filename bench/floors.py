"""Floors and ceilings, each measured in fresh processes with nothing else of ours running: the
best this host can do, which the service's figures are read against.

- `forward_floor`: scale + normalise + forward + softmax of a checkpoint at given batch sizes, input
  resident on the device, best of torch threads × OpenMP waiting × precision (fp32, and bf16
  autocast where the hardware runs it natively) × graph (eager, or the worker's traced serving
  graph, worker/checkpoints/forward_graph.py), a fresh process per (threads, OpenMP waiting, precision).
- `decode_ceiling`: Pillow decode + resize of one image to a model's input size in as many fresh
  processes as asked, all at once, best of with and without `Image.draft` (libjpeg's scaled
  decoding); these processes import no torch.
- `train_floor`: a tight training loop of the job's model, batch, optimizer and precision on
  resident uint8 data (bench/photos.py's "steady epoch" floor).

    python -m bench.floors forward CHECKPOINT BATCHES THREADS SECONDS DEVICE PRECISION
    python -m bench.floors decode IMAGE WIDTH HEIGHT DRAFT START_AT SECONDS
    python -m bench.floors train PARAMS_JSON
run by the functions below, one per fresh process.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/floors.py`: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import REPO, fresh_json

GRAPHS = ("eager", "traced")
# OpenMP's waiting between operators: libgomp's default, no spin at all, a short spin.
OMP_SETTINGS = {"default": {}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
                "GOMP_SPINCOUNT=30000": {"GOMP_SPINCOUNT": "30000"}}
OMP_VARIABLES = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")


def thread_counts() -> list[int]:
    return sorted({1, os.cpu_count() or 1})


def clean_env(omp: str = "default") -> dict[str, str]:
    """Our environment without any OpenMP setting, then `omp`'s."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES}
    return {**env, **OMP_SETTINGS[omp]}


# ----------------------------------------------------------------------------- a checkpoint
def make_checkpoint(data_dir: Path, model_name: str, size: int | None = None) -> tuple[str, Path]:
    """Untrained weights (seed 0) of `model_name` at its input size (or `size`×`size`), 10 classes,
    written with worker.checkpoints.format.save_model where the service finds a job's final checkpoint:
    what a forward costs does not depend on what the weights learned."""
    import torch

    from core.storage import CheckpointPaths
    from models.registry import build_model, get_model_spec
    from worker.checkpoints.format import ModelMeta, Preprocessing, save_model

    spec = get_model_spec(model_name).input
    height, width = (size, size) if size else (spec.height, spec.width)
    job_id = f"bench-{model_name.replace('_', '-')}"
    torch.manual_seed(0)
    model = build_model(model_name, 10).eval()
    meta = ModelMeta(model_name, 10, [f"class{i}" for i in range(10)],
                     Preprocessing(spec.channels, height, width, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), job_id)
    path = CheckpointPaths(data_dir / "checkpoints").final(job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(path, model, meta)
    return job_id, path


# ----------------------------------------------------------------------------- the forward
def raw_forward(checkpoint: Path, batch: int, seconds: float, graph: str, device: str = "cpu",
                precision: str = "fp32") -> dict[str, float] | None:
    """In this process, with whatever threads and OpenMP policy it was started with: the eager
    operators (`graph="eager"`, the classic script; under bf16 autocast with `precision="bf16"`, and
    channels_last on CUDA), or the worker's traced serving graph of the same operators (`"traced"`;
    None where the worker would not use it either: a trace that differs from the eager module)."""
    import torch

    from worker.checkpoints.format import load_model
    from worker.checkpoints.forward_graph import build_forward
    from worker.data.normalization import normalize, stats_tensors

    model, meta = load_model(checkpoint, device)
    mean, std = stats_tensors(meta.preprocessing, device)
    pre = meta.preprocessing
    cuda = device.startswith("cuda")
    x = torch.randint(0, 256, (batch, pre.channels, pre.height, pre.width), dtype=torch.uint8).to(device)
    if graph == "traced":
        traced = build_forward(model, pre, device)
        if traced.kind != "torchscript":  # the worker serves this model eagerly too (forward_graph logs why)
            return None
        run = traced.run
    else:
        if cuda and precision == "bf16":
            model = model.to(memory_format=torch.channels_last)

        def run(images: torch.Tensor) -> torch.Tensor:
            if precision == "bf16":
                with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16):
                    return torch.softmax(model(normalize(images, mean, std)).float(), dim=1)
            return torch.softmax(model(normalize(images, mean, std)), dim=1)

    def once() -> None:
        run(x)
        if cuda:
            torch.cuda.synchronize()

    times: list[float] = []
    with torch.inference_mode(), torch.jit.optimized_execution(False):
        for _ in range(20):
            once()
        cpu0 = time.process_time()
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop or len(times) < 3:
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
    return {"p50_ms": statistics.median(times) * 1e3, "images_s": batch / statistics.mean(times),
            "cpu_us_per_image": cpu * 1e6 / (batch * len(times))}


def _forward_main(checkpoint: str, batches: str, threads: int, seconds: float, device: str, precision: str) -> None:
    import torch

    torch.set_num_threads(threads)
    graphs = GRAPHS if precision == "fp32" else ("eager",)  # a trace records fp32 operators
    measured = [(int(batch), graph, raw_forward(Path(checkpoint), int(batch), seconds, graph, device, precision))
                for batch in batches.split(",") for graph in graphs]
    print(json.dumps([{**m, "graph": graph, "batch": batch} for batch, graph, m in measured if m is not None]))


def forward_floor(checkpoint: Path, batches: list[int], seconds: float, settings: list[tuple[int, str]],
                  device: str = "cpu", precisions: tuple[str, ...] = ("fp32",)) -> dict[int, dict[str, Any]]:
    """Per batch size: the best of `settings` (threads, OpenMP waiting) × `precisions` × graphs,
    each (setting, precision) in a fresh process; every figure kept under "tried". Best: the lowest
    p50 at batch 1, the most images/s at any other size."""
    tried: list[dict[str, Any]] = []
    for threads, omp in settings:
        for precision in precisions:
            out = fresh_json(["-m", "bench.floors", "forward", str(checkpoint), ",".join(map(str, batches)),
                              str(threads), str(seconds), device, precision], clean_env(omp))
            tried.extend({**measured, "threads": threads, "omp": omp, "precision": precision} for measured in out)
    best: dict[int, dict[str, Any]] = {}
    for batch in batches:
        mine = [t for t in tried if t["batch"] == batch]
        key = (lambda r: r["p50_ms"]) if batch == 1 else (lambda r: -r["images_s"])
        best[batch] = {**min(mine, key=key), "tried": mine}
    return best


# ----------------------------------------------------------------------------- decoding
def decode_to(data: bytes, width: int, height: int, draft: bool) -> Any:
    """Pillow decode + resize to width×height, as worker/data/image_array.image_to_array does it (RGB,
    bilinear, C×H×W uint8), with libjpeg's scaled decoding first when `draft`."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        if draft:
            image.draft("RGB", (width, height))
        rgb = image.convert("RGB")
        if rgb.size != (width, height):
            rgb = rgb.resize((width, height), Image.Resampling.BILINEAR)
        return np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1))


def _decode_main(path: str, width: int, height: int, draft: bool, start_at: float, seconds: float) -> None:
    data = Path(path).read_bytes()
    for _ in range(20):  # warm: the decoder's code and tables in cache
        decode_to(data, width, height, draft)
    while time.time() < start_at:
        time.sleep(0.001)
    began, cpu0, count = time.time(), time.process_time(), 0
    stop = began + seconds
    while time.time() < stop:
        decode_to(data, width, height, draft)
        count += 1
    elapsed = time.time() - began
    print(json.dumps({"images": count, "seconds": elapsed, "images_s": count / elapsed,
                      "cpu_ms_per_image": (time.process_time() - cpu0) * 1e3 / max(count, 1)}))


def decode_ceiling(image: Path, width: int, height: int, seconds: float, processes: int) -> dict[str, Any]:
    """`processes` fresh processes decoding `image` to width×height at the same moment, with and
    without draft: images/s summed over the processes; the best kept, both under "tried"."""
    import subprocess

    tried = []
    for draft in (False, True):
        start_at = time.time() + 1.0 + 0.1 * processes  # after every process has started and warmed
        argv = [sys.executable, "-m", "bench.floors", "decode", str(image), str(width), str(height),
                str(int(draft)), repr(start_at), str(seconds)]
        procs = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
        try:
            outs = [json.loads(p.communicate(timeout=seconds + 120)[0].strip().splitlines()[-1]) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        tried.append({"draft": draft, "processes": processes, "images_s": sum(o["images_s"] for o in outs),
                      "cpu_ms_per_image": statistics.mean(o["cpu_ms_per_image"] for o in outs),
                      "per_process": [round(o["images_s"], 1) for o in outs]})
    return {**max(tried, key=lambda t: t["images_s"]), "tried": tried}


# ----------------------------------------------------------------------------- training
def tight_train(params: dict[str, Any]) -> dict[str, Any]:
    """The job's model, batch size, optimizer and precision on `images` resident uint8 images
    (random, 10 classes) at its input size: normalise, forward, loss, backward, step, nothing
    else; images/s per epoch."""
    import torch
    from torch import nn

    from models.registry import build_model

    device = torch.device(params["device"])
    torch.manual_seed(0)
    n, size, batch = params["images"], params["image_size"], params["batch_size"]
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (n,), device=device)
    model = build_model(params["model"], 10).to(device)
    if params.get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
    optimizer_class = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[params["optimizer"]]
    optimizer = optimizer_class(model.parameters(), lr=params["learning_rate"])
    loss_fn = nn.CrossEntropyLoss()
    amp = params.get("amp_dtype")
    mean = torch.full((1, 3, 1, 1), 0.5, device=device)
    rates = []
    model.train()
    for _ in range(params["epochs"]):
        started = time.perf_counter()
        order = torch.randperm(n, device=device)
        for begin in range(0, n, batch):
            idx = order[begin:begin + batch]
            x = (images[idx].float().div_(255.0) - mean) / 0.25
            if params.get("channels_last"):
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device_type=device.type, dtype=getattr(torch, amp or "bfloat16"), enabled=amp is not None):
                loss = loss_fn(model(x), labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates.append(n / (time.perf_counter() - started))
    return {"images_per_second": max(rates[1:] or rates), "epochs": [round(r, 1) for r in rates]}


def train_floor(params: dict[str, Any], threads: list[int]) -> dict[str, Any]:
    """`tight_train` in a fresh process per torch thread count (one on a GPU); the best kept."""
    tried = []
    for count in threads:
        out = fresh_json(["-m", "bench.floors", "train", json.dumps({**params, "threads": count})], clean_env())
        tried.append({**out, "threads": count})
    return {**max(tried, key=lambda t: t["images_per_second"]), "tried": tried}


def _train_main(raw: str) -> None:
    import torch

    params = json.loads(raw)
    torch.set_num_threads(params["threads"])
    print(json.dumps(tight_train(params)))


def main(argv: list[str]) -> None:
    what, args = argv[0], argv[1:]
    if what == "forward":
        _forward_main(args[0], args[1], int(args[2]), float(args[3]), args[4], args[5])
    elif what == "decode":
        _decode_main(args[0], int(args[1]), int(args[2]), args[3] == "1", float(args[4]), float(args[5]))
    elif what == "train":
        _train_main(args[0])
    else:
        raise SystemExit(f"unknown floor {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
