"""bench/photos.py's figures as one table, the photo goals (/predict near its decode and forward
ceilings, a first job's cost outside its epochs small, ahead of LitServe) checked against them, and
its sections of docs/benchmarks.md.

Every ratio reads "how good, 1 = equal": the floor's time ÷ ours for times and ours ÷ the
ceiling for rates (≤ 1 against a floor), LitServe's time ÷ ours for times and ours ÷ LitServe's
for rates (above 1: torchyard is ahead).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bench.docs import write_section
from bench.harness import LOCK_HINT, machine

SECTIONS = {"cuda": ("photos-gpu", "Photos on a GPU host"), "cpu": ("photos-cpu", "Photos on this CPU host")}

# The GPU figures the photo goals were set against (measured by hand before bench/photos.py existed).
GPU_BEFORE = """Before (the figures the photo goals were set against: an NVIDIA H200 and 16 cores, landed e4ee7f5,
`TORCHYARD_API_WORKERS` default = 4, one GPU worker; a 500×375 JPEG of 38 KB; resnet18 trained at
`image_size` 224; measured by hand, not by bench/photos.py):

| what | measured | ceiling on the same host, same run |
| --- | --- | --- |
| `/predict`, 1 client, p50 | 6.1–6.2 ms | raw forward at batch 1: 1.3 ms |
| `/predict`, 32 clients | 682–951 images/s; p99 54 ms in one run, 486 ms in another | raw forward at batch 32: 16,000 images/s |
| `/predict`, 128 clients | 1,083–1,147 images/s (p50 109–115 ms) | Pillow decode + resize of that JPEG on all 16 cores: 7,650–7,920 images/s |
| first job on a new 3,000-photo upload, 3 epochs | 23.2–23.8 s wall, of which 8.6–8.9 s in epochs and 14.6–14.9 s outside them | the same job again on the now-decoded set: 5.3 s |
| its first epoch | 320–334 images/s (2,951 when the set was already decoded) | later epochs: 11,150–11,360 images/s |
"""


@dataclass
class Report:
    text: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    goals: list[dict[str, Any]] = field(default_factory=list)


def _n(value: float, unit: str) -> str:
    if unit == "img/s":
        return f"{value:,.0f} img/s"
    return f"{value:,.2f} {unit}" if value < 10 else f"{value:,.1f} {unit}"


def _row(rows: list[dict[str, Any]], what: str, measured: float, unit: str, floor: float | None = None,
         floor_text: str = "", lit: float | None = None, note: str = "") -> None:
    higher_better = unit == "img/s"
    ratio = None if not floor or not measured else (measured / floor if higher_better else floor / measured)
    vs_lit = None if not lit or not measured else (measured / lit if higher_better else lit / measured)
    rows.append({"what": what, "measured": measured, "unit": unit, "floor": floor, "ratio": ratio, "litserve": lit,
                 "vs_litserve": vs_lit, "cells": [
                     what, _n(measured, unit) + (f" ({note})" if note else ""),
                     (f"{_n(floor, unit)}: {floor_text}" if floor else floor_text or "–"),
                     "–" if ratio is None else f"{ratio:.2f}", "–" if lit is None else _n(lit, unit),
                     "–" if vs_lit is None else f"{vs_lit:.2f}"]})


def rows_for(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    up = results["upload"]
    _row(rows, f"upload: {up['num_images']} photos, {results['dataset']['bytes'] / 2**20:.0f} MB zip (POST /datasets)",
         up["seconds"], "s", note=f"{up['num_images'] / up['seconds']:,.0f} photos/s")
    for name, r in results["models"].items():
        m = f"{name}@{r['size']}"
        j1, j2 = r["job1"], r["job2"]
        decode_all = r["decode_all"]["images_s"]
        _row(rows, f"{m}: job 1 (fresh set), submit → succeeded", j1["wall_s"], "s")
        _row(rows, f"{m}: job 1, outside its epochs", j1["outside_s"], "s", up["num_images"] / decode_all,
             f"{up['num_images']} photos decoded at the all-core ceiling",
             note=f"until epoch 1 {j1['until_first_s']:.1f}, between epochs {j1['between_s']:.1f}, "
                  f"after {j1['after_last_s']:.1f}")
        _row(rows, f"{m}: job 1, inside its epochs", j1["inside_s"], "s")
        for key, label in (("job1", "job 1"), ("job2", "job 2 (decoded set)")):
            j = r[key]
            if key == "job2":
                _row(rows, f"{m}: {label}, submit → succeeded", j["wall_s"], "s")
                _row(rows, f"{m}: {label}, outside its epochs", j["outside_s"], "s")
            if len(j["epochs"]) > 1:
                _row(rows, f"{m}: {label}, epoch 1", j["epochs"][0], "img/s", j["epochs"][1], "its epoch 2")
        steady = max(v for j in (j1, j2) for v in (j["epochs"][1:] or j["epochs"]))
        _row(rows, f"{m}: steady epoch (best after the first, both jobs)", steady, "img/s",
             r["train_floor"]["images_per_second"], "tight loop, same batch, optimizer, precision")
        f1, f32 = r["forward"][1], r["forward"][32]
        one_core_ms = 1e3 / r["decode_one"]["images_s"]
        lit = r.get("litserve", {})
        for c, cell in sorted(r["predict"].items(), key=lambda kv: int(kv[0])):
            c = int(c)
            peer = lit.get(c) or lit.get(str(c)) or {}
            if c == 1:
                _row(rows, f"{m}: /predict, 1 client, p50", cell["p50_ms"], "ms", f1["p50_ms"] + one_core_ms,
                     f"forward batch 1 {f1['p50_ms']:.2f} + one-core decode {one_core_ms:.2f}", peer.get("p50_ms"))
                _row(rows, f"{m}: /predict, 1 client, p99", cell["p99_ms"], "ms", lit=peer.get("p99_ms"))
                continue
            ceiling = min(decode_all, f32["images_s"])
            which = "all-core decode" if decode_all <= f32["images_s"] else "forward batch 32"
            _row(rows, f"{m}: /predict, {c} clients", cell["images_s"], "img/s", ceiling, f"{which} (the lower)",
                 peer.get("images_s"))
            _row(rows, f"{m}: /predict, {c} clients, p50", cell["p50_ms"], "ms", lit=peer.get("p50_ms"))
            _row(rows, f"{m}: /predict, {c} clients, p99", cell["p99_ms"], "ms", lit=peer.get("p99_ms"),
                 note=f"{cell['p99_ms'] / cell['p50_ms']:.1f}× p50")
    return rows


def _goal(goals: list[dict[str, Any]], text: str, value: str, met: bool | None) -> None:
    goals.append({"goal": text, "value": value, "met": met})


def goals_for(results: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []
    cuda = results["host"] == "cuda"
    for name, r in results["models"].items():
        p, decode_all = r["predict"], r["decode_all"]["images_s"]
        if cuda:
            if 128 in p:
                a, b = p[128]["images_s"] / decode_all, p[128]["images_s"] / r["forward"][32]["images_s"]
                _goal(goals, f"{name}: /predict at 128 clients ≥ 0.6× the all-core decode ceiling, or ≥ 0.5× the "
                      "raw batch-32 forward", f"{a:.2f}× decode, {b:.2f}× forward", a >= 0.6 or b >= 0.5)
            if 32 in p:
                x = p[32]["p99_ms"] / p[32]["p50_ms"]
                _goal(goals, f"{name}: /predict at 32 clients, p99 ≤ 3× p50", f"{x:.1f}×", x <= 3)
            if 1 in p:
                bound = r["forward"][1]["p50_ms"] + 1e3 / r["decode_one"]["images_s"] + 1.5
                _goal(goals, f"{name}: /predict, 1 client, p50 ≤ forward batch 1 + one-core decode + 1.5 ms",
                      f"{p[1]['p50_ms']:.2f} against {bound:.2f} ms", p[1]["p50_ms"] <= bound)
            j1 = r["job1"]
            _goal(goals, f"{name}: first job ≤ 3 s outside its epochs", f"{j1['outside_s']:.1f} s", j1["outside_s"] <= 3)
            if len(j1["epochs"]) > 1:
                x = j1["epochs"][0] / j1["epochs"][1]
                _goal(goals, f"{name}: first epoch ≥ 0.8× the second", f"{x:.2f}×", x >= 0.8)
            steady = max(v for j in (r["job1"], r["job2"]) for v in (j["epochs"][1:] or j["epochs"]))
            x = steady / r["train_floor"]["images_per_second"]
            _goal(goals, f"{name}: steady epochs ≥ 0.95× the tight loop", f"{x:.2f}×", x >= 0.95)
        elif name == "cifar_net" and 32 in p:
            x = p[32]["images_s"] / decode_all
            _goal(goals, f"cifar_net: /predict of the JPEG at 32 clients ≥ 0.6× the {results['cores']}-core decode "
                  "ceiling", f"{p[32]['images_s']:,.0f} img/s = {x:.2f}× of {decode_all:,.0f}", x >= 0.6)
    compared = [row for row in rows if row["vs_litserve"] is not None]
    behind = [row["what"] for row in compared if row["vs_litserve"] <= 1]
    if results.get("litserve_note"):
        _goal(goals, "ahead of LitServe on every photo row", results["litserve_note"], None)
    else:
        _goal(goals, "ahead of LitServe on every photo row",
              f"{len(compared) - len(behind)} of {len(compared)} rows" + (f"; behind on: {'; '.join(behind)}" if behind else ""),
              bool(compared) and not behind)
    return goals


def _details(results: dict[str, Any]) -> list[str]:
    lines = []
    for name, r in results["models"].items():
        m = f"{name}@{r['size']}"
        for batch, best in r["forward"].items():
            every = "; ".join(f"{t['threads']} threads, {t['precision']}, {t['graph']}: {t['p50_ms']:.2f} ms / "
                              f"{t['images_s']:,.0f} img/s" for t in best["tried"])
            lines.append(f"- {m} forward, batch {batch}: best {best['threads']} threads, {best['precision']}, "
                         f"{best['graph']} ({every})")
        for key, label in (("decode_all", f"{results['cores']} processes"), ("decode_one", "1 process")):
            every = "; ".join(f"{'draft' if t['draft'] else 'no draft'}: {t['images_s']:,.0f} img/s "
                              f"({t['cpu_ms_per_image']:.2f} ms of CPU an image, per process {t['per_process']})"
                              for t in r[key]["tried"])
            lines.append(f"- {m} decode of the JPEG to {r['size']}×{r['size']}, {label}: {every}")
        tf = r["train_floor"]
        lines.append(f"- {m} tight training loop: {tf['images_per_second']:,.0f} img/s ({tf['threads']} threads; "
                     f"epochs {tf['epochs']}); job params: batch {r['job1']['params'].get('batch_size')}, "
                     f"{r['job1']['params'].get('optimizer')}, amp {r['job1']['params'].get('amp_dtype')}, "
                     f"channels_last {r['job1']['params'].get('channels_last')}")
        for key in ("job1", "job2"):
            j = r[key]
            lines.append(f"- {m} {key} on {j['device']}: epochs {[round(v) for v in j['epochs']]} img/s, "
                         f"{[round(s, 2) for s in j['epoch_seconds']]} s; queued {j['queued_s']:.2f} s, until epoch 1's "
                         f"record {j['until_first_s']:.2f} s, between epochs {j['between_s']:.2f} s, after the last "
                         f"{j['after_last_s']:.2f} s")
        decode_ms = {t["draft"]: t["cpu_ms_per_image"] for t in r["decode_one"]["tried"]}
        for c, cell in r["predict"].items():
            cpu = ", ".join(f"{k[:-7]} {v:.3f}" for k, v in cell.items() if k.endswith("_cpu_ms"))
            lines.append(f"- {m} /predict c={c}: {cell['requests']} requests; CPU ms per request: {cpu} (the JPEG's "
                         f"decode alone: {decode_ms[False]:.2f} ms of CPU without draft, {decode_ms[True]:.2f} with)")
        for c, cell in (r.get("litserve") or {}).items():
            lines.append(f"- {m} LitServe c={c}: best configuration {json.dumps(cell['config'])}")
    return lines


def build(results: dict[str, Any], argv: str) -> Report:
    rows = rows_for(results)
    goals = goals_for(results, rows)
    cuda = results["host"] == "cuda"
    command = (f"scripts/gpu-bench.sh {argv}" if cuda else
               f"{LOCK_HINT} .venv/bin/python bench/photos.py {argv}").strip()
    a = results["args"]
    head = [f"Command: `{command}`  ",
            f"Host: {machine(gpu=cuda)}  ",
            f"Measured {results['measured_at']} in {results['seconds']:.0f} s; load average "
            f"(1 min) {results['load_start']:.1f} at the start, {results['load_end']:.1f} at the end"
            + (" (a LOADED host: other work used the cores meanwhile, so the figures, the floors' as well as "
               "the service's, are lower and noisier than on a quiet host)" if max(results["load_start"], results["load_end"]) >= 1.5
               else "") + ".  ",
            f"{results['dataset']['photos']} photo-like JPEGs of 500×375 (mean {results['dataset']['mean_jpeg_bytes'] / 1e3:.0f} KB, "
            f"quality 85, 10 class folders, bench/photo_data.py); /predict sends one such JPEG of "
            f"{results['sample_bytes'] / 1e3:.0f} KB, `top_k=5`; {a['epochs']} epochs a job, service defaults "
            f"otherwise (`torchyard up`); {a['seconds']:g} s per /predict cell after {a['warmup']:g} s of warm-up.", ""]
    table = ["| what | measured | floor / ceiling (same run) | ratio | LitServe at its best | ratio to LitServe |",
             "|---|---|---|---|---|---|"] + ["| " + " | ".join(row["cells"]) + " |" for row in rows]
    legend = ("Ratios read 1 = equal: against the floor, the floor's time ÷ ours or our rate ÷ the ceiling; against "
              "LitServe, its time ÷ ours or our rate ÷ its rate (above 1: torchyard is ahead). "
              + (f"LitServe: best of {results.get('litserve_configs')} configurations per cell (bench/peers.py)."
                 if not results.get("litserve_note") else results["litserve_note"] + "."))
    above = [row["what"] for row in rows if row["ratio"] is not None and row["ratio"] > 1]
    if above:
        legend += (" A ratio above 1 against a floor (" + "; ".join(above) + ") means the floor's own run was "
                   "disturbed, this host's speed moving from one second to the next, not that the service beat it.")
    goal_lines = [f"- {'met' if g['met'] else 'NOT met' if g['met'] is False else 'not measured'}: {g['goal']}: "
                  f"{g['value']}" for g in goals]
    text = "\n".join(head + table + ["", legend, "", "The photo goals on this host:", ""] + goal_lines
                     + ["", "Floors, ceilings and the jobs in detail:", ""] + _details(results)) + "\n"
    return Report(text, rows, goals)


def write_docs(results: dict[str, Any], report: Report) -> None:
    name, title = SECTIONS[results["host"]]
    text = report.text + (f"\n{GPU_BEFORE}" if results["host"] == "cuda" else "")
    write_section(name, title, text + "\n")
