"""The forward beside a decoding thread: eager against the traced serving graph (worker/checkpoints/forward_graph.py).

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/forward_gil.py [--seconds 3] [--rounds 2] [--write-docs]

One process, as in a worker: a thread runs the serving forward (one torch thread, the way a CPU
worker's device thread runs it while a job trains, and always on a 2-core host) in a loop, alone
and then while another thread decodes 32×32 PNGs with worker/data/image_array.decode_image (PIL, as the
intake and decode threads do), for `--seconds` each; `--rounds` alternate the eager module and
the traced graph. Reported: images/s of the forward, and the decoder's CPU per image (its
thread's CPU time over the images it decoded), which GIL hand-offs inflate.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.docs import write_section  # noqa: E402 (after the sys.path entry above)
from bench.floors import make_checkpoint  # noqa: E402
from bench.predict import sample_png  # noqa: E402

CELLS = (("cifar_net", 32), ("resnet18", 32), ("cifar_net", 1))


def measure(model_name: str, batch: int, seconds: float, rounds: int) -> list[dict[str, float | str]]:
    import torch

    from worker.checkpoints.format import load_model
    from worker.checkpoints.forward_graph import ServingForward, build_forward
    from worker.data.image_array import InputSpec, decode_image

    torch.set_num_threads(1)
    _, path = make_checkpoint(Path(tempfile.mkdtemp()), model_name)
    network, meta = load_model(path, "cpu")
    pre = meta.preprocessing
    graph = build_forward(network, pre, "cpu")
    assert graph.kind == "torchscript"
    eager = ServingForward(network, pre.mean, pre.std).eval()
    images = torch.randint(0, 256, (batch, pre.channels, pre.height, pre.width), dtype=torch.uint8)
    png = sample_png()
    spec = InputSpec.of(meta.preprocessing)

    def forward_loop(run: Callable[[torch.Tensor], torch.Tensor], stop: threading.Event, done: list[int]) -> None:
        torch.set_num_threads(1)
        with torch.inference_mode(), torch.jit.optimized_execution(False):
            run(images)
            while not stop.is_set():
                run(images)
                done[0] += 1

    def one(run: Callable[[torch.Tensor], torch.Tensor], beside_decoder: bool) -> tuple[float, float | None]:
        stop, done = threading.Event(), [0]
        thread = threading.Thread(target=forward_loop, args=(run, stop, done))
        thread.start()
        time.sleep(0.2)  # past the first calls
        done[0] = 0
        started, cpu0, decoded = time.perf_counter(), time.thread_time(), 0
        if beside_decoder:
            while time.perf_counter() - started < seconds:
                decode_image(png, spec, 10**8)
                decoded += 1
        else:
            time.sleep(seconds)
        elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu0
        stop.set()
        thread.join()
        return done[0] * batch / elapsed, (cpu * 1e6 / decoded if decoded else None)

    rows: list[dict[str, float | str]] = []
    for _ in range(rounds):
        for label, run in (("eager", eager), ("traced", graph.run)):
            alone, _ = one(run, False)
            beside, decode_us = one(run, True)
            rows.append({"model": model_name, "batch": batch, "forward": label, "alone": alone, "beside": beside,
                         "decode_us": decode_us or 0.0})
            print(rows[-1], file=sys.stderr)
    return rows


def decode_alone(seconds: float) -> float:
    from worker.checkpoints.format import ModelMeta, Preprocessing
    from worker.data.image_array import InputSpec, decode_image

    meta = ModelMeta("cifar_net", 10, [str(i) for i in range(10)], Preprocessing(3, 32, 32, (0.5,) * 3, (0.25,) * 3),
                     "x")
    png = sample_png()
    spec = InputSpec.of(meta.preprocessing)
    started, cpu0, decoded = time.perf_counter(), time.thread_time(), 0
    while time.perf_counter() - started < seconds:
        decode_image(png, spec, 10**8)
        decoded += 1
    return (time.thread_time() - cpu0) * 1e6 / decoded


def report(rows: list[dict[str, float | str]], alone_us: float, seconds: float) -> str:
    lines = [f"A forward thread (one torch thread) alone and beside a thread decoding 32×32 PNGs, {seconds:g} s per "
             f"cell, each row a round; the decoder alone used {alone_us:.1f} µs of CPU per image:", "",
             "| model | batch | forward | alone | beside the decoder | decoder's CPU per image |",
             "|---|---:|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['batch']} | {row['forward']} | {row['alone']:,.0f} img/s | "
                     f"{row['beside']:,.0f} img/s | {row['decode_us']:.1f} µs |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true", help="replace the forward-gil section of docs/benchmarks.md")
    args = parser.parse_args()
    alone_us = decode_alone(args.seconds)
    rows = [row for model, batch in CELLS for row in measure(model, batch, args.seconds, args.rounds)]
    text = report(rows, alone_us, args.seconds)
    print(text)
    if args.write_docs:
        command = f"flock /tmp/torchyard-bench.lock .venv/bin/python bench/forward_gil.py --seconds {args.seconds:g} " \
                  f"--rounds {args.rounds}"
        write_section("forward-gil", "The forward beside decoding threads (the GIL)", f"Command: `{command}`\n\n{text}")


if __name__ == "__main__":
    main()
