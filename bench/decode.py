"""Decoding images for training: one image (full decode against JPEG draft), and a whole uploaded
set (one loop, a thread pool, the process pool of worker/data/dataset_decode.py).

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/decode.py [--jpegs 1200] [--pngs 12000] [--rounds 5]

Generated files, like the photo workload (bench/photos.py): 500×375 JPEGs (tests/datagen.photo_jpeg:
quality 85, a smooth random colour field with pixel noise, ~40 KB), one 2000×1500 JPEG, and
32×32 PNGs of noise, three classes.

1. Per image, in this process on one thread: open + decode + convert + resize, µs per image,
   best of --rounds, CPU time of this process (a shared host's other tenants do not inflate it)
   and wall time, for `image_to_array` as it is (draft) and with the image loaded before the call
   (the full decode it did before), and the mean / max absolute difference of the two in uint8
   levels.
2. Per set: images/s (wall) to decode --jpegs JPEGs (at 224×224 and at 32×32) or --pngs PNGs (at
   32×32), each variant in a fresh
   process, alternating, --rounds rounds: `loop` (one thread, what load_image_folder did),
   `threads-k` (a ThreadPoolExecutor of k threads over the same chunks), `processes-k`
   (worker/data/dataset_decode.decode_files with k processes, at the caller's priority like the
   others: a worker runs them niced; its first call in a process starts the forkserver, reported
   apart as `first call`).
3. Per decoder (--only decoders): Pillow's transform, torchvision's decode_jpeg + torch's uint8
   resize, and what decode_image chooses, over --workers processes at once (one core, all cores),
   images/s and CPU µs per image, for a 500×375 photo to 224 and to 32, a 32×32 JPEG, a 2000×1500
   photo to 224 (resize 256, crop): what `fast_jpeg_plan` chooses from.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SPECS = {"jpeg-224": ("jpg", (3, 224, 224, None)), "jpeg-32": ("jpg", (3, 32, 32, None)),
         "png-32": ("png", (3, 32, 32, None))}


def generate(root: Path, jpegs: int, pngs: int) -> None:
    import numpy as np
    from PIL import Image

    from tests.datagen import photo_jpeg

    for kind in ("jpg", "png"):
        for c in range(3):
            (root / kind / f"c{c}").mkdir(parents=True, exist_ok=True)
    for i in range(jpegs):
        (root / "jpg" / f"c{i % 3}" / f"{i:05d}.jpg").write_bytes(photo_jpeg(500, 375, seed=i))
    for i in range(pngs):
        noise = np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(noise).save(root / "png" / f"c{i % 3}" / f"{i:05d}.png")
    (root / "photo-2000x1500.jpg").write_bytes(photo_jpeg(2000, 1500, seed=7))


def per_image(root: Path, rounds: int) -> list[dict]:
    import numpy as np
    from PIL import Image

    from worker.data.image_array import image_to_array

    cases = [("500x375 JPEG -> 32x32", sorted((root / "jpg").glob("*/*.jpg"))[:20], (3, 32, 32, None)),
             ("500x375 JPEG -> 224x224", sorted((root / "jpg").glob("*/*.jpg"))[:20], (3, 224, 224, None)),
             ("2000x1500 JPEG -> 224x224 (shorter side 256, centre crop)", [root / "photo-2000x1500.jpg"],
              (3, 224, 224, 256)),
             ("2000x1500 JPEG -> 224x224", [root / "photo-2000x1500.jpg"], (3, 224, 224, None))]
    rows = []
    for name, paths, spec in cases:
        blobs = [p.read_bytes() for p in paths]
        repeat = max(1, 40 // len(blobs))

        def run(draft: bool, blobs: list[bytes] = blobs, spec: tuple = spec) -> list:
            import io
            out = []
            for blob in blobs:
                with Image.open(io.BytesIO(blob)) as image:
                    if not draft:
                        image.load()  # decoded in full before the transform sees it
                    out.append(image_to_array(image, *spec))
            return out

        result: dict[str, object] = {"case": name}
        for label, draft in (("full", False), ("draft", True)):
            best_cpu = best_wall = float("inf")
            for _ in range(rounds):
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(repeat):
                    run(draft)
                best_cpu = min(best_cpu, (time.process_time() - cpu) / (repeat * len(blobs)))
                best_wall = min(best_wall, (time.perf_counter() - wall) / (repeat * len(blobs)))
            result[f"{label}_cpu_us"] = round(best_cpu * 1e6)
            result[f"{label}_wall_us"] = round(best_wall * 1e6)
        diff = np.concatenate([np.abs(a.astype(int) - b.astype(int)).ravel() for a, b in zip(run(False), run(True), strict=True)])
        result["mean_abs_diff"] = round(float(diff.mean()), 2)
        result["max_abs_diff"] = int(diff.max())
        rows.append(result)
    return rows


# Pillow's C calls that release the GIL while they run (checked by `releases_gil` below): the
# decoder and the resampler. Everything else of a decode runs Python or holds the GIL.
GIL_FREE_CALLS = ("ImagingDecoder.decode", "ImagingCore.resize")


def releases_gil(call: Callable[[], object]) -> float:
    """How much a thread that counts in Python gets done while `call` runs, against what it does
    alone in the same time: near 0 when the call holds the GIL throughout (the counter waits for
    it), near the share of a core the host gives it when the call releases it. Controls: a sort of
    a long list (holds it), time.sleep (releases it)."""
    import threading

    counted = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    def counts_in(seconds: float | None) -> tuple[int, float]:
        counted[0] = 0
        stop.clear()
        spinner = threading.Thread(target=count)
        began = time.perf_counter()
        spinner.start()
        if seconds is None:
            call()
        else:
            time.sleep(seconds)
        stop.set()
        spinner.join()
        return counted[0], time.perf_counter() - began

    during, elapsed = counts_in(None)
    alone, _ = counts_in(elapsed)
    return round(during / max(1, alone), 3)


def gil_share(root: Path, rounds: int) -> list[dict]:
    """Per image, one thread: the CPU time of the whole decode (best of --rounds, no profiler) and
    the part of it inside the calls that release the GIL (thread CPU time between their c_call and
    c_return, under sys.setprofile: the profiler's own cost lands outside them). The rest holds
    the GIL, so k threads decode at most 1 / (held + free / k) times one thread (Amdahl); k
    processes are not bound by it."""
    import io
    import random

    from PIL import Image

    from worker.data.image_array import image_to_array

    big = (root / "photo-2000x1500.jpg").read_bytes()
    loaded = Image.open(io.BytesIO(big))
    loaded.load()

    def decode_big() -> None:
        for _ in range(10):
            with Image.open(io.BytesIO(big)) as image:
                image.load()

    numbers = [random.random() for _ in range(3_000_000)]
    checked = {"ImagingDecoder.decode (10 decodes of the 2000x1500 JPEG)": releases_gil(decode_big),
               "ImagingCore.resize (10 resizes of it)": releases_gil(
                   lambda: [loaded.resize((1500, 1100), Image.Resampling.BILINEAR) for _ in range(10)]),
               "control: sorted() of 3 million floats": releases_gil(lambda: sorted(numbers)),
               "control: time.sleep(0.3)": releases_gil(lambda: time.sleep(0.3))}
    cases = [("500x375 JPEG -> 224x224", sorted((root / "jpg").glob("*/*.jpg"))[:20], (3, 224, 224, None)),
             ("500x375 JPEG -> 32x32", sorted((root / "jpg").glob("*/*.jpg"))[:20], (3, 32, 32, None)),
             ("32x32 PNG -> 32x32", sorted((root / "png").glob("*/*.png"))[:200], (3, 32, 32, None))]
    rows = []
    for name, paths, spec in cases:
        blobs = [p.read_bytes() for p in paths]

        def run(blobs: list[bytes] = blobs, spec: tuple = spec) -> None:
            for blob in blobs:
                with Image.open(io.BytesIO(blob)) as image:
                    image_to_array(image, *spec)

        total = float("inf")
        for _ in range(rounds):
            began = time.thread_time()
            run()
            total = min(total, (time.thread_time() - began) / len(blobs))
        free = float("inf")
        for _ in range(rounds):
            timer = GilFreeTimer()
            sys.setprofile(timer.profile)
            try:
                run()
            finally:
                sys.setprofile(None)
            free = min(free, timer.inside / len(blobs))
        held = max(0.0, total - free)
        rows.append({"case": name, "cpu_us_per_image": round(total * 1e6, 1), "gil_free_us": round(free * 1e6, 1),
                     "gil_held_share": round(held / total, 3),
                     "thread_ceiling_2_cores": round(1 / (held / total + free / total / 2), 2),
                     "thread_ceiling_16_cores": round(1 / (held / total + free / total / 16), 2),
                     "worker_copies_us_per_image": round(_chunk_copies_us(spec), 1)})
    rows.append({"spinner_progress_during_call": checked})
    return rows


class GilFreeTimer:
    """A sys.setprofile hook: the thread CPU time spent inside GIL_FREE_CALLS."""

    def __init__(self) -> None:
        self.inside = 0.0
        self.started: list[float] = []

    def profile(self, frame: object, event: str, arg: object) -> None:
        if event == "c_call" and getattr(arg, "__qualname__", "") in GIL_FREE_CALLS:
            self.started.append(time.thread_time())
        elif event in ("c_return", "c_exception") and getattr(arg, "__qualname__", "") in GIL_FREE_CALLS:
            self.inside += time.thread_time() - self.started.pop()


def _chunk_copies_us(spec: tuple) -> float:
    """What a process pool adds per image in the worker, approximated by what dominates it: a
    chunk of 64 arrays crosses as bytes (one copy out of the pipe into the result's array) and
    is copied into its rows of the set's array (a second copy). The child's own copies run in
    the child."""
    import numpy as np

    chunk = np.random.default_rng(0).integers(0, 256, (64, spec[0], spec[1], spec[2]), dtype=np.uint8)
    received = chunk.tobytes()
    target = np.empty_like(chunk)
    best = float("inf")
    for _ in range(20):
        began = time.thread_time()
        target[:] = np.frombuffer(bytearray(received), dtype=np.uint8).reshape(chunk.shape)
        best = min(best, time.thread_time() - began)
    return best / 64 * 1e6


CHILD = r'''
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from worker.data.dataset_decode import decode_chunk, decode_files, CHUNKS_PER_PROCESS, MAX_CHUNK
from worker.data.image_array import InputSpec

def main():
    root, kind, spec_json, variant = Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    spec = InputSpec(*json.loads(spec_json))
    files = sorted((root / kind).glob("*/*"))
    strs = [str(f) for f in files]
    def loop():
        decode_chunk(strs, spec)
    def threads(k):
        size = max(1, min(MAX_CHUNK, -(-len(strs) // (k * CHUNKS_PER_PROCESS))))
        with ThreadPoolExecutor(k) as pool:
            list(pool.map(lambda b: decode_chunk(strs[b:b + size], spec), range(0, len(strs), size)))
    name, _, k = variant.partition("-")
    run = {"loop": loop, "threads": lambda: threads(int(k)),
           "processes": lambda: decode_files(files, spec, int(k), nice=0)}[name]
    times = []
    for _ in range(3):
        start = time.perf_counter(); run(); times.append(time.perf_counter() - start)
    print(json.dumps({"first": len(files) / times[0], "best": len(files) / min(times[1:])}))

if __name__ == "__main__":
    main()
'''


def per_set(root: Path, rounds: int, workers: list[int]) -> dict:
    variants = ["loop"] + [f"threads-{k}" for k in workers] + [f"processes-{k}" for k in workers]
    results: dict = {case: {v: [] for v in variants} for case in SPECS}
    firsts: dict = {case: [] for case in SPECS}
    for _ in range(rounds):
        for case, (kind, spec) in SPECS.items():
            for variant in variants:
                out = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(root), kind, json.dumps(spec), variant],
                                     capture_output=True, text=True, check=True)
                measured = json.loads(out.stdout.strip().splitlines()[-1])
                results[case][variant].append(round(measured["best"]))
                if variant.startswith("processes"):
                    firsts[case].append(round(measured["first"]))
    return {"images_per_second": results, "processes_first_call": firsts}


# The two CPU decoders of a JPEG, side by side (docs/benchmarks.md, "CPU JPEG decoders"): Pillow's
# transform (open, draft where it pays, convert, BILINEAR resize) against torchvision's decode_jpeg +
# torch's antialiased uint8 resize (worker/data/torch_jpeg.py), and what decode_image chooses.
DECODER_CASES = [("500x375 JPEG -> 224x224", (500, 375), (3, 224, 224, None)),
                 ("500x375 JPEG -> 32x32", (500, 375), (3, 32, 32, None)),
                 ("32x32 JPEG -> 32x32", (32, 32), (3, 32, 32, None)),
                 ("2000x1500 JPEG -> 224x224 (shorter side 256, centre crop)", (2000, 1500), (3, 224, 224, 256))]

DECODER_CHILD = r'''
import io, json, sys, time
sys.path.insert(0, sys.argv[1])
from PIL import Image
from tests.datagen import photo_jpeg
from worker.data import torch_jpeg
from worker.data.image_array import InputSpec, decode_image, fast_jpeg_plan, image_to_array, _shorter_side_size

size, spec, decoder, count = json.loads(sys.argv[2]), InputSpec(*json.loads(sys.argv[3])), sys.argv[4], int(sys.argv[5])
blobs = [photo_jpeg(*size, seed=i) for i in range(20)]
resized = (spec.width, spec.height) if spec.resize_size is None else _shorter_side_size(tuple(size), spec.resize_size)

def pillow(blob):
    with Image.open(io.BytesIO(blob)) as image:
        return image_to_array(image, spec.channels, spec.height, spec.width, spec.resize_size)

def torchvision(blob):
    return torch_jpeg.decode(blob, spec.channels, spec.height, spec.width, resized, spec.resize_size is not None)

def chosen(blob):
    return decode_image(blob, spec, 10**9)

run = {"pillow": pillow, "torchvision": torchvision, "chosen": chosen}[decoder]
for blob in blobs:
    run(blob)  # warm: first calls, torch's thread pinning
print("ready", flush=True)
sys.stdin.readline()
began, cpu = time.perf_counter(), time.process_time()
for i in range(count):
    run(blobs[i % len(blobs)])
print(json.dumps({"wall_s": time.perf_counter() - began, "cpu_s": time.process_time() - cpu}), flush=True)
'''


def decoders(rounds: int, processes: list[int], count: int) -> list[dict]:
    """Per case and decoder, images/s of k processes decoding at once (each `count` images, started
    together once all are warm: k × count / the slowest one's wall time) and the CPU µs per image;
    every variant in fresh processes, the decoders alternating within each round."""
    rows = []
    for name, size, spec in DECODER_CASES:
        for k in processes:
            measured: dict[str, list] = {d: [] for d in ("pillow", "torchvision", "chosen")}
            cpu: dict[str, list] = {d: [] for d in measured}
            for _ in range(rounds):
                for decoder in measured:
                    children = [subprocess.Popen([sys.executable, "-c", DECODER_CHILD, str(REPO), json.dumps(size),
                                                  json.dumps(spec), decoder, str(count)],
                                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                                for _ in range(k)]
                    for child in children:
                        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
                    for child in children:
                        assert child.stdin is not None
                        child.stdin.write("go\n")
                        child.stdin.flush()
                    results = [json.loads(child.communicate()[0].strip().splitlines()[-1]) for child in children]
                    measured[decoder].append(round(k * count / max(r["wall_s"] for r in results)))
                    cpu[decoder].append(round(sum(r["cpu_s"] for r in results) / (k * count) * 1e6))
            rows.append({"case": name, "processes": k, "images_per_second": measured, "cpu_us_per_image": cpu})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jpegs", type=int, default=1200)
    parser.add_argument("--pngs", type=int, default=12000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--only", choices=["image", "gil", "set", "decoders"])
    parser.add_argument("--count", type=int, default=400, help="images per process (--only decoders)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        generate(root, args.jpegs, args.pngs)
        load = os.getloadavg()[0]
        if args.only in (None, "image"):
            for row in per_image(root, args.rounds):
                print(json.dumps(row), flush=True)
        if args.only in (None, "gil"):
            for row in gil_share(root, args.rounds):
                print(json.dumps(row), flush=True)
        if args.only in (None, "decoders"):
            decoders(args.rounds, [int(k) for k in args.workers.split(",")], args.count)
        if args.only in (None, "set"):
            print(json.dumps(per_set(root, args.rounds, [int(k) for k in args.workers.split(",")])), flush=True)
        print(json.dumps({"load_average_start_end": [round(load, 2), round(os.getloadavg()[0], 2)],
                          "cores": len(os.sched_getaffinity(0))}))


if __name__ == "__main__":
    main()
