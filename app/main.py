"""The FastAPI application: routers, error mapping and the services' lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from app.api.deps import require_api_key
from app.api.errors import install_error_handlers
from app.api.routes import datasets, devices, health, jobs, models, predict
from app.api.services import Services
from app.core.config import Settings, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.services = Services.build(settings)
        try:
            yield
        finally:
            await app.state.services.close()

    app = FastAPI(title="torchyard", version="1.0.0", lifespan=lifespan,
                  description="Train and serve PyTorch image classifiers on your GPUs.")
    install_error_handlers(app)
    app.include_router(health.router)
    protected = [Depends(require_api_key)]
    for module in (devices, models, datasets, jobs, predict):
        app.include_router(module.router, dependencies=protected)
    return app
