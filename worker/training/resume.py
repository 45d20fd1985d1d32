"""What a training run carries across deliveries: after every epoch the trainer writes the model,
optimizer, scheduler, gradient scaler, early stopping, micro-batch size, best epoch so far, RNG
states and metrics to a resume file of that epoch (recorded with the epoch's metrics); the next
delivery of the job reads the last one back and continues after that epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.schemas import EpochMetrics
from worker.checkpoints.format import load_payload, save_resume_state
from worker.training.backoff import BatchBackoff
from worker.training.evaluation import Measured
from worker.training.recipe import EarlyStopping


@dataclass
class BestEpoch:
    epoch: int
    state_dict: dict[str, torch.Tensor]  # on the CPU
    measured: Measured

    @classmethod
    def of(cls, epoch: int, model: nn.Module, measured: Measured) -> BestEpoch:
        return cls(epoch, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, measured)


@dataclass
class ResumableRun:
    """The objects of a run whose state a resume file holds."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LR scheduler, or None
    scaler: torch.amp.GradScaler
    stopper: EarlyStopping
    backoff: BatchBackoff
    device: torch.device

    def save(self, path: Path, epoch: int, history: list[EpochMetrics], best: BestEpoch | None,
             stop_reason: str | None) -> None:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        save_resume_state(path, {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict(), "stopper": self.stopper.state_dict(),
            "micro_batch": self.backoff.size, "stop_reason": stop_reason,
            "best": None if best is None else {"epoch": best.epoch, "state_dict": best.state_dict,
                                               "loss": best.measured.loss, "accuracy": best.measured.accuracy,
                                               "num_images": best.measured.num_images,
                                               "confusion": best.measured.confusion},
            "epoch": epoch, "rng": rng, "metrics": [m.model_dump() for m in history],
        })

    def restore(self, path: Path, history: list[EpochMetrics]) -> tuple[int, BestEpoch | None, str | None]:
        """(the first epoch to run, the best epoch so far, why an earlier delivery stopped early),
        after the epoch `path` was written at. A resume file written before the recipe existed has
        no scheduler, scaler or best state: its job ran without them."""
        state = load_payload(path, map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("stopper"):
            self.stopper.load_state_dict(state["stopper"])
        self.backoff.size = min(self.backoff.size, int(state.get("micro_batch") or self.backoff.size))
        torch.set_rng_state(state["rng"]["cpu"].cpu())
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), self.device)
        history.extend(EpochMetrics.model_validate(m) for m in state["metrics"])
        best = None
        if state.get("best"):
            saved = state["best"]
            best = BestEpoch(int(saved["epoch"]), {k: v.cpu() for k, v in saved["state_dict"].items()},
                             Measured(int(saved["num_images"]), float(saved["loss"]), float(saved["accuracy"]),
                                      saved["confusion"].cpu()))
        return int(state["epoch"]) + 1, best, state.get("stop_reason")
