from __future__ import annotations

from fastapi import APIRouter

from core.schemas import ModelInfo, ModelInput, ModelList
from models.registry import MODELS

router = APIRouter(tags=["models"])


@router.get("/models", response_model=ModelList)
def list_models() -> ModelList:
    """The architectures a job can train: name, description, input shape, parameter count."""
    return ModelList(models=[
        ModelInfo(name=spec.name, description=spec.description, parameters=spec.parameters,
                  input=ModelInput(channels=spec.input.channels, height=spec.input.height, width=spec.input.width))
        for spec in MODELS.values()
    ])
