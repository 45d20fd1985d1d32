"""Where a training job's first weights come from: another job's checkpoint (`init_from`) or
torchvision's ImageNet weights (`pretrained`), and how they go into a freshly built model.

Both load onto the worker's device (`map_location`, `weights_only=True`). The classifier head (the
module `models/registry.py` names per architecture) is kept when the classes are the same ones
(reordered when only their order differs); otherwise it keeps its fresh initialisation for the new
classes while every other weight is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core.config import Settings
from core.schemas import Job
from core.storage import CheckpointPaths
from models.pretrained import WeightsMissing, load_pretrained_state
from models.registry import get_model_spec
from worker.checkpoints.format import ModelMeta, load_payload
from worker.runtime.job_context import JobFailed


@dataclass(frozen=True)
class InitialWeights:
    state_dict: dict[str, torch.Tensor]
    classes: list[str] | None  # what its head predicts; None: ImageNet's 1000 (always replaced)
    mean: tuple[float, ...]  # the normalisation those weights were trained with: kept for the new job
    std: tuple[float, ...]
    resize_ratio: float | None  # resize_size / crop of their eval transform (pretrained), if any
    lineage: dict[str, Any]


def from_job(parent: Job, paths: CheckpointPaths, device: torch.device) -> InitialWeights:
    """The final weights of a succeeded training job."""
    payload = load_payload(paths.final(parent.id), map_location=device)
    meta = ModelMeta.from_dict(payload["meta"])
    pre = meta.preprocessing
    return InitialWeights(
        state_dict=payload["state_dict"], classes=meta.classes, mean=pre.mean, std=pre.std,
        resize_ratio=pre.resize_size / pre.height if pre.resize_size else None,
        lineage={"init_from": parent.id, "init_from_sha256": parent.checkpoint.sha256 if parent.checkpoint else None,
                 "init_from_lineage": meta.lineage},
    )


def from_pretrained(architecture: str, settings: Settings, device: torch.device) -> InitialWeights:
    weights = get_model_spec(architecture).pretrained
    if weights is None:
        raise JobFailed(f"{architecture} has no pretrained weights")
    try:
        state = load_pretrained_state(weights, settings.hub_dir, allow_download=settings.allow_download,
                                      map_location=device)
    except WeightsMissing as exc:
        raise JobFailed(str(exc)) from None
    return InitialWeights(state_dict=state, classes=None, mean=weights.mean, std=weights.std,
                          resize_ratio=weights.resize_size / weights.crop_size,
                          lineage={"pretrained": weights.name, "file": weights.file_name})


def apply(model: nn.Module, architecture: str, initial: InitialWeights, classes: list[str]) -> str:
    """Load `initial` into `model` (built for `classes`). Returns what happened to the head: "kept",
    "reordered" (same classes, another order) or "reinitialised"."""
    prefix = get_model_spec(architecture).head + "."
    state = dict(initial.state_dict)
    if initial.classes is not None and sorted(initial.classes) == sorted(classes):
        how = "kept"
        if initial.classes != classes:
            order = torch.tensor([initial.classes.index(name) for name in classes])
            for key in [k for k in state if k.startswith(prefix)]:
                state[key] = state[key].index_select(0, order.to(state[key].device))
            how = "reordered"
        _load(model, architecture, state, strict=True)
        return how
    _load(model, architecture, {k: v for k, v in state.items() if not k.startswith(prefix)}, strict=False)
    return "reinitialised"


def _load(model: nn.Module, architecture: str, state: dict[str, torch.Tensor], *, strict: bool) -> None:
    prefix = get_model_spec(architecture).head + "."
    try:
        missing, unexpected = model.load_state_dict(state, strict=strict)
    except RuntimeError as exc:  # shape mismatches
        raise JobFailed(f"the starting weights do not fit {architecture}: {str(exc)[:500]}") from None
    missing = [k for k in missing if not k.startswith(prefix)]
    if missing or unexpected:
        raise JobFailed(f"the starting weights do not fit {architecture}: missing {missing[:5]}, "
                        f"unexpected {list(unexpected)[:5]}")
