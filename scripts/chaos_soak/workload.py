"""The soak's workload: what a careful client does. It uploads a small dataset, then submits
jobs one after another, each with a fresh Idempotency-Key, retrying the same key and body on any
failure (connection refused or reset, timeout, 5xx) until acknowledged (202, or 200 for a retry
the server had already accepted), and keeps at most --in-flight of its jobs unfinished. What it
was told (`Submitted`) is what scripts/chaos_soak/checks.py holds the server to."""

from __future__ import annotations

import argparse
import io
import threading
import time
import uuid
import zipfile
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from PIL import Image

from . import TERMINAL, log


def dataset_zip(per_class: int, seed: int) -> bytes:
    """Two learnable classes of 32×32 images: warm noise and cool noise."""
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for label, tint in (("warm", (200, 90, 40)), ("cool", (40, 90, 200))):
            for k in range(per_class):
                noise = rng.normal(0, 40, (32, 32, 3))
                pixels = np.clip(np.array(tint) + noise, 0, 255).astype(np.uint8)
                out = io.BytesIO()
                Image.fromarray(pixels).save(out, format="PNG")
                archive.writestr(f"{label}/{k:03d}.png", out.getvalue())
    return buffer.getvalue()


@dataclass
class Submitted:
    """One job as the client sent it, and the id it was acknowledged with (None until then)."""

    key: str
    body: dict[str, Any]
    job_id: str | None = None
    acked_at: float = 0.0
    tries: int = 0


class Workload:
    """The client side of the soak, until `stop_event` is set."""

    def __init__(self, args: argparse.Namespace, client: httpx.Client, stop_event: threading.Event) -> None:
        self.args = args
        self.client = client
        self.stop_event = stop_event
        self.submitted: list[Submitted] = []
        self.retried = 0
        self.dataset = ""
        self.finished: set[str] = set()

    def upload_dataset(self) -> None:
        body = dataset_zip(self.args.images_per_class, self.args.seed)
        while True:
            try:
                answer = self.client.post("/datasets", data={"name": "chaos"},
                                          files={"file": ("chaos.zip", body, "application/zip")})
                if answer.status_code == 201:
                    self.dataset = answer.json()["id"]
                    return
                log(f"dataset upload answered {answer.status_code}: {answer.text[:200]}")
            except httpx.HTTPError as exc:
                log(f"dataset upload failed ({exc!r}); retrying")
            time.sleep(1)

    def submit(self, index: int) -> Submitted:
        """POST /jobs with one Idempotency-Key until acknowledged; every failure is retried as is."""
        item = Submitted(key=f"chaos-{uuid.uuid4()}", body={
            "model": "cifar_net", "dataset": self.dataset, "epochs": self.args.epochs, "batch_size": 16,
            "patience": 0,  # every epoch runs, so "each epoch recorded once" is checked on all of them
            "seed": index, "val_fraction": 0.2})
        every = self.args.gang_every
        if every and index % every == every - 1:
            item.body.update(world_size=2, elastic=(index // every) % 2 == 1)
        self.submitted.append(item)
        pause = 0.2
        while not self.stop_event.is_set():
            item.tries += 1
            try:
                answer = self.client.post("/jobs", json=item.body, headers={"Idempotency-Key": item.key})
            except httpx.HTTPError:
                answer = None
            if answer is not None and answer.status_code in (200, 202):
                job_id = answer.json()["id"]
                if item.job_id is not None and item.job_id != job_id:
                    raise AssertionError(f"key {item.key} answered with jobs {item.job_id} and {job_id}")
                item.job_id, item.acked_at = job_id, time.monotonic()
                return item
            if answer is not None and answer.status_code < 500:
                raise AssertionError(f"POST /jobs answered {answer.status_code}: {answer.text[:300]}")
            self.retried += 1
            time.sleep(pause)
            pause = min(pause * 2, 2.0)
        return item

    def unfinished(self) -> int:
        count = 0
        for item in self.submitted:
            if item.job_id is None or item.job_id in self.finished:
                continue
            try:
                if self.client.get(f"/jobs/{item.job_id}", timeout=5).json()["status"] in TERMINAL:
                    self.finished.add(item.job_id)
                    continue
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            count += 1
        return count

    def submitter(self) -> None:
        index = 0
        while not self.stop_event.is_set():
            if self.unfinished() >= self.args.in_flight:
                time.sleep(0.5)
                continue
            self.submit(index)
            index += 1

