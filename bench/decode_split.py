"""Where decoding processes pay for /predict: a batch of 32 identical images decoded on the calling
thread alone, against half of them sent to one decoding process while the calling thread decodes
the rest (worker/serving/decode.Decoder's split on a 2-core host), for images from a 32×32 PNG to
a 500×375 photo. Where the ratio passes 1 is worker/serving/decode.DecodeSplit's threshold, which it
keeps in units of the host's reference decode (REFERENCE_DECODES).

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/decode_split.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
from PIL import Image

from bench.photo_data import jpeg as photo_jpeg_of
from worker.data.image_array import InputSpec
from worker.serving.decode_processes import DecodeProcesses, decode_chunk

BATCH = 32


def _encoded(size: int, fmt: str) -> bytes:
    buffer = io.BytesIO()
    array = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(array).save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cases: list[tuple[str, bytes, InputSpec]] = [
        ("32×32 PNG → 32", _encoded(32, "PNG"), InputSpec(3, 32, 32)),
        ("64×64 JPEG → 32", _encoded(64, "JPEG"), InputSpec(3, 32, 32)),
        ("256×256 JPEG → 64", _encoded(256, "JPEG"), InputSpec(3, 64, 64)),
        ("500×375 photo → 32", photo_jpeg_of(0, 0), InputSpec(3, 32, 32)),
        ("500×375 photo → 224", photo_jpeg_of(0, 0), InputSpec(3, 224, 224)),
    ]
    processes = DecodeProcesses(1, 10**8)
    first = [cases[0][1]]
    processes.gather([first], [processes.submit(first, cases[0][2])], cases[0][2])  # the pool started
    print("| image → input | CPU per image | one thread, 32 images | split with one process | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, data, spec in cases:
        batch = [data] * BATCH
        inline = split = float("inf")
        cpu = float("inf")
        for _ in range(args.rounds):
            began, began_cpu = time.perf_counter(), time.thread_time()
            decode_chunk(batch, spec, 10**8)
            inline = min(inline, time.perf_counter() - began)
            cpu = min(cpu, (time.thread_time() - began_cpu) / BATCH)
            began = time.perf_counter()
            half = batch[: BATCH // 2]
            pending = processes.submit(half, spec)
            decode_chunk(batch[BATCH // 2:], spec, 10**8)
            processes.gather([half], [pending], spec)
            split = min(split, time.perf_counter() - began)
        print(f"| {name} | {cpu * 1e6:,.0f} µs | {inline * 1e3:.2f} ms | {split * 1e3:.2f} ms | {inline / split:.2f} |")
    processes.shutdown()


if __name__ == "__main__":
    main()
