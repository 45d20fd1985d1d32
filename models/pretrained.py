"""torchvision's ImageNet weights for the architectures that have them: which file, where it is
looked up, and the preprocessing those weights expect.

Weights come through torchvision's weights API (`ResNet18_Weights.DEFAULT`, ...) and torch.hub's
loader: the file is looked up in a hub cache under the data dir
(`$TORCHYARD_DATA_DIR/hub/checkpoints/<file>`, torch.hub's own layout) and downloaded there only
when `TORCHYARD_ALLOW_DOWNLOAD=true`; a download is checked against the hash in the file's name
(`check_hash=True`, torchvision's integrity check). Loading is `weights_only=True`. Nothing here
touches the network or CUDA at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PretrainedWeights:
    """One torchvision weights enum member and the eval transform it was trained for."""

    enum: str  # e.g. "ResNet18_Weights"
    member: str  # e.g. "IMAGENET1K_V1" (what DEFAULT points to)
    url: str
    crop_size: int  # the eval transform: resize the shorter side to resize_size, centre-crop crop_size
    resize_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def name(self) -> str:
        return f"{self.enum}.{self.member}"

    @property
    def file_name(self) -> str:
        """The name torch.hub stores it under (the URL's last part, with its hash prefix)."""
        return Path(urlparse(self.url).path).name

    def path(self, hub_dir: Path) -> Path:
        return hub_dir / "checkpoints" / self.file_name

    def resize_for(self, crop: int) -> int:
        """The shorter side to resize to before a centre crop of `crop`: the weights' ratio (256/224)."""
        return round(crop * self.resize_size / self.crop_size)


def torchvision_default(enum_name: str) -> PretrainedWeights:
    """The DEFAULT member of a torchvision weights enum, read from torchvision itself (what the
    registry's entries are checked against)."""
    from torchvision import models as tvm

    weights = getattr(tvm, enum_name).DEFAULT
    transform = weights.transforms()
    return PretrainedWeights(
        enum=enum_name, member=weights.name, url=weights.url,
        crop_size=int(transform.crop_size[0]), resize_size=int(transform.resize_size[0]),
        mean=tuple(float(v) for v in transform.mean), std=tuple(float(v) for v in transform.std),
    )


class WeightsMissing(Exception):
    """The weights file is not in the hub cache and may not be downloaded."""


def load_pretrained_state(weights: PretrainedWeights, hub_dir: Path, *, allow_download: bool,
                          map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The weights' state_dict from the hub cache (downloaded there first when allowed).

    torch.hub's loader checks the hash of a file it downloads (`check_hash=True`) and reads with
    `weights_only=True`; a file already in the cache is read as it is (the operator put it there)."""
    import torch  # here, not at import: the API reads this module's metadata without torch

    path = weights.path(hub_dir)
    if not path.exists() and not allow_download:
        raise WeightsMissing(missing_message(weights, hub_dir))
    return torch.hub.load_state_dict_from_url(weights.url, model_dir=str(path.parent), map_location=map_location,
                                              progress=False, check_hash=True, weights_only=True)


def missing_message(weights: PretrainedWeights, hub_dir: Path) -> str:
    return (f"pretrained weights {weights.name} are not on this server: put {weights.file_name} (from "
            f"{weights.url}) at {weights.path(hub_dir)}, or set TORCHYARD_ALLOW_DOWNLOAD=true to let the "
            f"worker download it there")
