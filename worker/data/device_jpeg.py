"""JPEGs decoded on the device: nvJPEG through torchvision's batched `decode_jpeg`, the resize on the
device, the CPU path for every image nvJPEG is not given or refuses. Two callers: /predict's batches
(worker/serving/decode.py, rows handed to the forward on the device) and an upload's first decode
(worker/data/device_dataset_decode.py, rows copied back into the set's host array); the plan, the
batching under the pixel budget, the retry per image and the sticky-error rule are written once, here.

Why: on a GPU host the CPU decode is the wall (2.2-2.4 ms of a worker's 2.5 ms of CPU per photo,
issue 40), while nvJPEG decodes a batch of photos on the GPU for a fraction of the forward's cost.
`TORCHYARD_DECODE` (core/config.py) chooses: `cpu` never, `cuda` on a CUDA worker, `auto` on a CUDA
worker until a GPU measurement says otherwise (docs/gpu.md, "Decoding on the GPU": the figure is
owed). The same code runs with `device=cpu` (torchvision's decode_jpeg takes a list there too),
which is how the CPU tests exercise the selection, the batching and every fallback.

Every CUDA call here is checked against torchvision's / PyTorch's documentation (docs/gpu.md):

- `torchvision.io.decode_jpeg(list_of_cpu_uint8_tensors, mode=..., device="cuda")`: the inputs
  must be on the CPU whatever the device; a list is decoded as one batch; the CUDA version is
  thread-safe; it returns no partial results on an error (the whole call raises), so a failed
  batch is decoded again one image at a time, and an image that fails alone goes to the CPU path;
- `torchvision.transforms.v2.functional.resize(uint8 tensor on the device, antialias=True)`: any
  device (a uint8 image on CUDA is resized in float32 and rounded back);
- nothing else here: /predict's rows go to the forward as device tensors (`torch.stack`), no host
  copy; an upload's first decode stacks a group's rows and copies them back with `.cpu()`, which
  waits for the group's kernels (worker/data/device_dataset_decode.py).

What nvJPEG is not given (`device_jpeg_plan`): anything but an 8-bit baseline Huffman JPEG of one
or three components (progressive, 12-bit, CMYK, arithmetic coding, PNG and the other formats), a
file without its end-of-image marker (truncated: the CPU path refuses it with 415, where the GPU
might decode garbage), an image over the pixel limit (the CPU path's 413), or a resize that the CPU
path makes with libjpeg's scaled decode (the contract's draft: Pillow keeps those). Device memory is
bounded: a batch's images are split into groups of at most `batch_pixels` decoded pixels, by their
headers, before any is decoded. A sticky device error (an illegal access, a device-side assert:
worker/device/health.py) is re-raised, never swallowed: the engine's assembly thread classifies it
as the device loop does a forward's and takes the worker out of service.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from core.image_headers import read_header
from worker.data.image_array import BadImage, InputSpec, fast_jpeg_plan
from worker.device.health import sticky_device_error

END_OF_IMAGE = b"\xff\xd9"
BASELINE_FRAMES = (0xC0, 0xC1)  # SOF0, SOF1: what nvJPEG's GPU path takes (progressive goes to the CPU)

Row = torch.Tensor | BadImage
Plan = tuple[tuple[int, int], bool, int]  # resize to (width, height), centre crop after it, decoded pixels


def device_decodes(setting: str, device_kind: str) -> bool:
    """Does a worker of `device_kind` decode JPEGs on its device (/predict's, and an upload's first
    decode: worker/data/device_dataset_decode.py), under TORCHYARD_DECODE=`setting`? `cpu` never; `cuda` and `auto` on a CUDA device (auto: until a GPU measurement says
    the CPU path is faster there; a CPU worker has no other device to decode on)."""
    return setting != "cpu" and device_kind == "cuda"


def device_jpeg_plan(data: bytes, spec: InputSpec, max_pixels: int) -> Plan | None:
    """(resize to (width, height), centre crop after it, the decoded pixels) for a JPEG nvJPEG is
    given, or None for the CPU path. Decided on the header alone."""
    header = read_header(data)
    if header is None or header.frame not in BASELINE_FRAMES or not data.endswith(END_OF_IMAGE):
        return None
    if header.width * header.height > max_pixels:
        return None  # the CPU path refuses it with the limit in its message
    plan = fast_jpeg_plan(data, spec, max_pixels)  # the CPU fast decoder's rules: 8-bit, 1 or 3 components, no draft
    if plan is None:
        return None
    return plan[0], plan[1], header.width * header.height


def pixel_groups(plans: list[Plan | None], batch_pixels: int) -> list[list[int]]:
    """The planned images' indices in groups of at most `batch_pixels` decoded pixels, in order (one
    image alone may exceed it: its own group, bounded by the pixel limit). What bounds the device
    memory one nvJPEG call holds."""
    groups: list[list[int]] = []
    current: list[int] = []
    pixels = 0
    for i, plan in enumerate(plans):
        if plan is None:
            continue
        if current and pixels + plan[2] > batch_pixels:
            groups.append(current)
            current, pixels = [], 0
        current.append(i)
        pixels += plan[2]
    if current:
        groups.append(current)
    return groups


class DeviceJpegDecoder:
    """A batch's images → rows on `device` (uint8 C×H×W), each decoded by nvJPEG where the plan
    gives it there, by `cpu` (the CPU path: bytes → uint8 array, or BadImage) otherwise."""

    def __init__(self, device: torch.device, max_pixels: int, batch_pixels: int) -> None:
        self.device = device
        self.max_pixels = max_pixels
        self.batch_pixels = batch_pixels
        self.on_device = 0  # images decoded by nvJPEG so far, and by the CPU path (counters for the stats)
        self.on_cpu = 0

    def decode(self, blobs: list[bytes], spec: InputSpec, cpu: Callable[[bytes], np.ndarray]) -> list[Row]:
        """Every image's row: nvJPEG's for the planned JPEGs it decodes, `cpu`'s (as a device tensor)
        or its refusal for the rest."""
        rows: list[torch.Tensor | None] = self.decode_planned(blobs, spec)
        return [row if row is not None else self._on_cpu(blob, cpu) for blob, row in zip(blobs, rows, strict=True)]

    def decode_planned(self, blobs: list[bytes], spec: InputSpec) -> list[torch.Tensor | None]:
        """nvJPEG's row for each image the plan gives it and it decodes; None for the others (the
        caller's CPU path). Groups under `batch_pixels`, one batched call each."""
        rows: list[torch.Tensor | None] = [None] * len(blobs)
        plans = [device_jpeg_plan(blob, spec, self.max_pixels) for blob in blobs]
        for group in pixel_groups(plans, self.batch_pixels):
            decoded = self.decode_batch([blobs[i] for i in group], [p for i in group if (p := plans[i]) is not None], spec)
            for i, row in zip(group, decoded, strict=True):
                rows[i] = row
        return rows

    def decode_batch(self, blobs: list[bytes], plans: list[Plan], spec: InputSpec) -> list[torch.Tensor | None]:
        """One nvJPEG call for `blobs` (planned: `plans`, one group of `pixel_groups`), each row resized
        (and cropped) on the device; if the batch call fails, each image alone; one that fails alone
        is None, left to the CPU path. A sticky device error is raised, never swallowed."""
        from torchvision.io import ImageReadMode, decode_jpeg

        mode = ImageReadMode.GRAY if spec.channels == 1 else ImageReadMode.RGB
        inputs = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]
        try:
            decoded: list[torch.Tensor | None] = list(decode_jpeg(inputs, mode=mode, device=self.device))
        except RuntimeError as exc:
            self._raise_if_sticky(exc)
            decoded = []
            for one in inputs:
                try:
                    decoded.append(decode_jpeg([one], mode=mode, device=self.device)[0])
                except RuntimeError as alone:
                    self._raise_if_sticky(alone)
                    decoded.append(None)
        rows: list[torch.Tensor | None] = []
        for image, plan in zip(decoded, plans, strict=True):
            rows.append(None if image is None else self._resize(image, spec, plan[0], plan[1]))
        self.on_device += sum(row is not None for row in rows)
        return rows

    @staticmethod
    def _resize(image: torch.Tensor, spec: InputSpec, resized: tuple[int, int], crop: bool) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as F

        if (image.shape[2], image.shape[1]) != resized:
            image = F.resize(image, [resized[1], resized[0]], interpolation=F.InterpolationMode.BILINEAR,
                             antialias=True)
        if crop:
            h, w = image.shape[1], image.shape[2]
            top, left = round((h - spec.height) / 2.0), round((w - spec.width) / 2.0)
            image = image[:, top:top + spec.height, left:left + spec.width]
        return image.contiguous()

    def _on_cpu(self, blob: bytes, cpu: Callable[[bytes], np.ndarray]) -> Row:
        self.on_cpu += 1
        try:
            return torch.from_numpy(cpu(blob)).to(self.device)
        except BadImage as bad:
            return bad

    @staticmethod
    def _raise_if_sticky(exc: RuntimeError) -> None:
        if sticky_device_error(exc) is not None:
            raise exc

