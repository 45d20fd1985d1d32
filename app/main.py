"""The FastAPI application: routers, error mapping and the services' lifetime."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from app.api.deps import require_api_key
from app.api.errors import install_error_handlers
from app.api.limits import BodyLimit
from app.api.routes import dashboard, datasets, devices, health, jobs, metrics, models, predict
from app.api.services import Services
from app.core.config import Settings, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.services = Services.build(settings)
        # What is loaded by now lives as long as the process: keep it out of the collector's full
        # passes, which otherwise scan it all and stalled every request in flight ~200 ms each time.
        gc.freeze()
        try:
            yield
        finally:
            await app.state.services.close()

    # FastAPI's own /docs and /openapi.json would be open to anyone; ours sit behind the API key.
    app = FastAPI(title="torchyard", version="1.0.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, description="Train and serve PyTorch image classifiers on your GPUs.")
    install_error_handlers(app)
    # /predict: at most max_images_per_request images of max_image_bytes each, plus multipart framing.
    predict_cap = settings.max_images_per_request * (settings.max_image_bytes + 64 * 1024) + 1024**2
    app.add_middleware(BodyLimit, max_bytes=settings.request_body_limit, max_json_bytes=settings.max_json_bytes,
                       per_path={"/predict": predict_cap})
    metrics.install_metrics(app)  # outermost: counts every request, the rejected ones too
    app.include_router(health.router)
    dashboard.install_dashboard(app)  # `/` and /static: no data in them, so no key needed
    protected = [Depends(require_api_key)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=protected)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=protected)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="torchyard API")

    for module in (devices, models, datasets, jobs, predict, metrics):
        app.include_router(module.router, dependencies=protected)
    return app
