"""How much of one image's decode holds the GIL, and so how many decode threads can run at once.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/decode_gil.py [--seconds 2] [--repeats 3] [--write-docs]

The decode is the worker's own, worker/data/image_array.decode_image with a checkpoint's
preprocessing, on three images: the photo of bench/photos.py (a 500×375 JPEG of ~38 KB) to
224×224 (resnet18 at 224) and to 32×32 (cifar_net), and a 32×32 PNG (bench/predict.py's) to
32×32. Two measures, each the best of `--repeats` (a shared host: the best is the least disturbed):
  (a) the GIL's share f: the decoder in a loop on one thread beside a thread running pure Python
      without a pause, which needs the GIL all the time: the wall time the spinner did not run is
      the time the decoder held the GIL (hand-offs included), f = that ÷ the decoder's CPU time
      (corrected for the share of the wall time the OS gave the spinner when it ran alone);
      Amdahl then bounds N decode threads to 1 / (f + (1 − f) / N) times one thread;
  (b) the scaling itself: images/s of 1 and N threads in one process, against 1 and N fresh
      processes (no GIL shared), N = the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/decode_gil.py`: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.docs import write_section
from bench.harness import LOCK_HINT, REPO, load_average, machine

CASES = {"jpeg-224": ("500×375 JPEG → 224×224", 224), "jpeg-32": ("500×375 JPEG → 32×32", 32),
         "png-32": ("32×32 PNG → 32×32", 32)}
MAX_PIXELS = 40_000_000  # core/config.Settings.max_image_pixels' default
GPU_HOST_CORES = 16  # the GPU host the photo goals were set on (docs/benchmarks.md, "Photos on a GPU host")


def image(case: str) -> bytes:
    if case.startswith("jpeg"):
        from bench.photo_data import sample_jpeg

        return sample_jpeg()
    from bench.predict import sample_png

    return sample_png()


def decoder(case: str):
    """A function decoding the case's image once, as the worker does it."""
    from worker.checkpoints.format import ModelMeta, Preprocessing
    from worker.data.image_array import InputSpec, decode_image

    size = CASES[case][1]
    meta = ModelMeta("bench", 10, [str(i) for i in range(10)],
                     Preprocessing(3, size, size, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), "bench")
    data = image(case)
    spec = InputSpec.of(meta.preprocessing)
    for _ in range(20):
        decode_image(data, spec, MAX_PIXELS)
    return lambda: decode_image(data, spec, MAX_PIXELS)


def _loop(decode, stop: float, counts: list[int], slot: int) -> None:
    n = 0
    while time.perf_counter() < stop:
        decode()
        n += 1
    counts[slot] = n


def threads_rate(decode, threads: int, seconds: float) -> float:
    """Images/s of `threads` threads of this process decoding at once."""
    counts = [0] * threads
    stop = time.perf_counter() + seconds
    workers = [threading.Thread(target=_loop, args=(decode, stop, counts, k)) for k in range(threads)]
    began = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - began)


def _spin(stop: float, cpu: list[float]) -> None:
    began = time.thread_time()
    while time.perf_counter() < stop:
        pass
    cpu[0] = time.thread_time() - began


def spinner_share(decode, seconds: float) -> dict[str, float]:
    """(a): a thread running pure Python without a pause, first alone, then beside the decoder in a
    loop on this thread. The spinner needs the GIL at every moment, so the wall time it could not
    run beside the decoder is the time the decoder held the GIL (hand-offs included: an upper
    bound). On a host whose other tenants take cores, the spinner alone runs only a share r of the
    wall time; beside the decoder it is held to that share of the time the GIL was free, so the
    decoder's share is r × wall − the spinner's CPU time, over the decoder's CPU time."""
    alone = [0.0]
    began = time.perf_counter()
    _spin(began + seconds, alone)
    runs = alone[0] / (time.perf_counter() - began)  # r: the share of the wall time the OS gave it
    stop = time.perf_counter() + seconds
    beside = [0.0]
    spinner = threading.Thread(target=_spin, args=(stop, beside))
    wall0 = time.perf_counter()
    spinner.start()
    cpu0, n = time.thread_time(), 0
    while time.perf_counter() < stop:
        decode()
        n += 1
    decode_cpu = time.thread_time() - cpu0
    spinner.join()
    wall = time.perf_counter() - wall0
    held = max(0.0, runs * wall - beside[0])
    return {"f": min(1.0, held / decode_cpu), "held_ms": held * 1e3 / n, "cpu_ms": decode_cpu * 1e3 / n,
            "decode_beside": n / wall, "spinner_share_alone": runs}


def processes_rate(case: str, processes: int, seconds: float) -> float:
    """Images/s of `processes` fresh processes decoding at the same moment."""
    start_at = time.time() + 2.0 + 0.5 * processes
    argv = [sys.executable, "-m", "bench.decode_gil", "--child", case, repr(start_at), str(seconds)]
    procs = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    try:
        return sum(json.loads(p.communicate(timeout=seconds + 300)[0].strip().splitlines()[-1]) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _child(case: str, start_at: float, seconds: float) -> None:
    decode = decoder(case)
    while time.time() < start_at:
        time.sleep(0.001)
    print(json.dumps(threads_rate(decode, 1, seconds)))


def scaling_f(row: dict[str, Any], cores: int) -> float | None:
    """(b) read as f: Amdahl's law solved for f with the threads' speed-up over the parallelism the
    host really gave (the processes' speed-up); None when the host gave too little to tell."""
    host = min(row["rates"][f"processes_{cores}"] / row["rates"]["processes_1"], cores)
    speedup = row["rates"][f"threads_{cores}"] / row["rates"]["threads_1"]
    return None if host < 1.2 else min(1.0, max(0.0, (host / speedup - 1) / (host - 1)))


def amdahl(f: float, n: int) -> float:
    return 1 / (f + (1 - f) / n)


def measure(case: str, seconds: float, repeats: int, cores: int) -> dict[str, Any]:
    decode = decoder(case)
    cpu0 = time.thread_time()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        decode()
        n += 1
    cpu_ms = (time.thread_time() - cpu0) * 1e3 / n
    shares = [spinner_share(decode, seconds) for _ in range(repeats)]
    best = min(shares, key=lambda s: s["f"])  # the least disturbed: a busy host only adds to it
    rates: dict[str, float] = {}
    for label, run in (("threads_1", lambda: threads_rate(decode, 1, seconds)),
                       (f"threads_{cores}", lambda: threads_rate(decode, cores, seconds)),
                       ("processes_1", lambda: processes_rate(case, 1, seconds)),
                       (f"processes_{cores}", lambda: processes_rate(case, cores, seconds))):
        rates[label] = max(run() for _ in range(repeats))
    return {"case": case, "cpu_ms": cpu_ms, "share": best, "shares": [round(s["f"], 3) for s in shares], "rates": rates}


def report(rows: list[dict[str, Any]], argv: str, cores: int, loads: tuple[float, float], seconds: float,
           repeats: int) -> str:
    lines = [f"Command: `{LOCK_HINT} .venv/bin/python bench/decode_gil.py {argv}`".replace(" `", "`", 0),
             "",
             f"Host: {machine()}; a host shared with other work, so each figure is the best of {repeats} "
             f"repeats of {seconds:g} s; load average (1 min) {loads[0]:.1f} at the start, {loads[1]:.1f} at the end"
             + (" (a LOADED host: the others' work took cores meanwhile, which inflates f and flattens the "
                "speed-ups)" if max(loads) >= 1.5 else " (a quiet moment)")
             + f". Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
             f"| image (worker/data/image_array.decode_image) | CPU per image, one thread | GIL held: f, per image (each repeat's f) "
             f"| Amdahl bound: {cores} threads, any number | {cores} threads ÷ 1 thread, measured "
             f"| {cores} processes ÷ 1 process, measured | f from the two speed-ups |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        f = r["share"]["f"]
        t1, tn = r["rates"]["threads_1"], r["rates"][f"threads_{cores}"]
        p1, pn = r["rates"]["processes_1"], r["rates"][f"processes_{cores}"]
        bound = f"{1 / f:.1f}×" if f > 0.01 else "no bound"
        scaled = "–" if (f_scaled := scaling_f(r, cores)) is None else f"{f_scaled:.2f}"
        lines.append(f"| {CASES[r['case']][0]} | {r['cpu_ms']:.3f} ms | {f:.2f}, {r['share']['held_ms']:.3f} ms "
                     f"({', '.join(f'{x:.2f}' for x in r['shares'])}) "
                     f"| {amdahl(f, cores):.2f}×, {bound} | {tn / t1:.2f}× ({t1:,.0f} → {tn:,.0f} img/s) "
                     f"| {pn / p1:.2f}× ({p1:,.0f} → {pn:,.0f} img/s) | {scaled} |")
    lines += ["", "f is the share of a decode's CPU time the decoder holds the GIL, measured beside a thread "
              "running pure Python (the wall time that thread did not get, over the decoder's CPU time; an upper "
              "bound: the GIL's hand-offs count as the decoder's). A pool of N decode threads "
              "can decode at most 1 / (f + (1 − f) / N) times as fast as one thread, and never more than 1 / f, "
              "however many cores; the processes' column is the same work with no GIL shared, the host's own "
              "limit (cores, memory bandwidth, other tenants), and the last column solves Amdahl's law for f "
              "from the threads' speed-up over the parallelism the processes got (– when they got little)."]
    lines += ["", "What it implies for a pool of decode threads in one process, by Amdahl's law with the f of each "
              "column (the spinner's, an upper bound, and the speed-ups', where measured):", ""]
    for r in rows:
        fs = [r["share"]["f"]] + [f for f in [scaling_f(r, cores)] if f is not None]
        at = "; ".join(f"{n} threads at most " + " to ".join(f"{x:.1f}×" for x in sorted(amdahl(f, n) for f in fs))
                       for n in sorted({cores, GPU_HOST_CORES}))
        lines.append(f"- {CASES[r['case']][0]}: {at} one thread's rate")
    lines += ["", f"({GPU_HOST_CORES} cores: the GPU host of the photo goals.) Where that is well under the cores, decoding "
              "in threads leaves cores idle, and only processes (or a decoder that never takes the GIL) use them all."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES))
    parser.add_argument("--write-docs", action="store_true", help="replace the decode-gil section of docs/benchmarks.md")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], float(args.child[1]), float(args.child[2]))
        return
    cores = os.cpu_count() or 1
    start = load_average()
    rows = []
    for case in args.cases:
        rows.append(measure(case, args.seconds, args.repeats, cores))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    argv = " ".join(a for a in sys.argv[1:] if a != "--write-docs")
    text = report(rows, argv, cores, (start, load_average()), args.seconds, args.repeats)
    print(text)
    if args.write_docs:
        write_section("decode-gil", "The decode stage and the GIL", text)


if __name__ == "__main__":
    main()
