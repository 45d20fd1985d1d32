"""The one checkpoint format: a plain dict of tensors and metadata, loadable with weights_only=True.

Final weights (model.pt) carry everything needed to rebuild and preprocess:
architecture, num_classes, channels, image size, normalisation and class names. The resumable
state (resume-<epoch>.pt, one per epoch of a delivery, recorded with that epoch's metrics) adds
optimizer, epoch and RNG state so a redelivered job picks up where it left off.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.storage import atomic_path
from models.registry import build_model

FORMAT = "torchyard.checkpoint/1"


@dataclass(frozen=True)
class Preprocessing:
    """How an image becomes the model's input: the eval transform of training, recorded."""

    channels: int
    height: int
    width: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    # Pretrained weights' eval transform: resize the shorter side to this, then centre-crop
    # (height, width). None: resize straight to (width, height).
    resize_size: int | None = None

    @property
    def transform(self) -> str:
        """The eval transform of training and of /predict (worker/data/image_array.py), spelled out in
        every checkpoint so a user can reproduce a prediction with PIL and numpy alone."""
        if self.resize_size is None:
            size = "resize((width, height), BILINEAR) unless already that size"
        else:
            size = (f"resize so the shorter side is {self.resize_size} (BILINEAR) → centre crop (height, width), "
                    f"top/left offsets round((size - crop) / 2)")
        return ("PIL.Image.open → first frame (GIF/WebP) → convert('L' if channels == 1 else 'RGB') → "
                f"{size} → uint8 array H×W×C → C×H×W → float32 / 255 → (x - mean[c]) / std[c] per channel; "
                "no random crop, no flip")


@dataclass(frozen=True)
class ModelMeta:
    architecture: str
    num_classes: int
    classes: list[str]
    preprocessing: Preprocessing
    job_id: str
    # Where the first weights came from: {"init_from": job id, "init_from_sha256", "head"} or
    # {"pretrained": "ResNet18_Weights.IMAGENET1K_V1", "file", "head"}; None: from scratch.
    lineage: dict[str, Any] | None = None
    # How training ended: {"best_epoch", "keep", "stop_reason", "epochs_run"}.
    training: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["preprocessing"]["mean"] = list(self.preprocessing.mean)
        data["preprocessing"]["std"] = list(self.preprocessing.std)
        data["preprocessing"]["transform"] = self.preprocessing.transform  # for people; not read back
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelMeta:
        pre = data["preprocessing"]
        return cls(
            architecture=data["architecture"],
            num_classes=int(data["num_classes"]),
            classes=list(data["classes"]),
            preprocessing=Preprocessing(int(pre["channels"]), int(pre["height"]), int(pre["width"]),
                                        tuple(float(v) for v in pre["mean"]), tuple(float(v) for v in pre["std"]),
                                        int(pre["resize_size"]) if pre.get("resize_size") else None),
            job_id=data["job_id"],
            lineage=data.get("lineage"),
            training=data.get("training"),
        )


class CheckpointError(Exception):
    """A checkpoint file that is missing, truncated, or not ours."""


def save_model(path: Path, model: nn.Module, meta: ModelMeta) -> None:
    """Write final weights atomically; state_dict tensors are moved to the CPU so any host loads them."""
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    payload = {"format": FORMAT, "torch_version": str(torch.__version__), "meta": meta.to_dict(), "state_dict": state}
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def load_payload(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load any torchyard checkpoint safely: weights_only=True, never an arbitrary unpickle."""
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except Exception as exc:  # truncated zip, foreign pickle, ...
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path.name} of job {path.parent.name} cannot be read "
                              f"safely (weights_only=True): {first_line[:300]}") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a {FORMAT} file")
    return payload


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[nn.Module, ModelMeta]:
    """Rebuild the architecture and load the weights straight onto `device` (map_location)."""
    payload = load_payload(path, map_location=device)
    meta = ModelMeta.from_dict(payload["meta"])
    model = build_model(meta.architecture, meta.num_classes, meta.preprocessing.channels)
    model.load_state_dict(payload["state_dict"])
    return model.to(device).eval(), meta


def save_resume_state(path: Path, state: dict[str, Any]) -> None:
    with atomic_path(path) as tmp:
        torch.save({"format": FORMAT, **state}, tmp)
