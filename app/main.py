"""The FastAPI application: routers, error mapping, the front gate and the services' lifetime."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis
from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.access import authorize
from app.api.deps import bearer_scheme
from app.api.errors import install_error_handlers, unexpected_error_response
from app.api.front import FrontGate
from app.api.oip import routes as oip_routes
from app.api.routes import (
    access,
    aliases,
    dashboard,
    datasets,
    devices,
    exports,
    health,
    jobs,
    metrics,
    models,
    predict,
    projects,
    sweeps,
)
from app.api.services import Services
from app.api.serving.direct import DIRECT
from core import keys
from core.access.projects import acting_everywhere, fail_closed, restore_default
from core.config import Settings, get_settings
from core.retention import CLEANUP_RETRY_S, Retention

log = logging.getLogger(__name__)

DOCS_ASSETS = "/docs/assets"  # Swagger UI's JavaScript and CSS (app/api/front.py serves them without the key)


def swagger_ui_assets() -> str:
    """The directory of Swagger UI's files in the fastapi-offline wheel (a maintained copy of the
    swagger-ui-dist files FastAPI would load from a CDN)."""
    import fastapi_offline

    return str(Path(fastapi_offline.__file__).resolve().parent / "static")


def _stop_if_cancelled() -> None:
    """Raise CancelledError if this task was asked to stop. redis-py's asyncio client can turn the
    cancellation of a command it is waiting on (a BLPOP) into a ConnectionError, which a loop that
    rides out Redis's outages would take for one and go round again: the app's shutdown then waited
    for ever (seen with a short sweeps tick). The request to stop is still counted on the task."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


STOP_WAIT_S = 5.0  # how long the app's shutdown waits for its background tasks to end


async def _stop_tasks(tasks: tuple[asyncio.Task[None], ...]) -> None:
    """Cancel the background tasks and wait for them, for STOP_WAIT_S at most: a task whose Redis
    command swallowed the cancellation (redis-py's asyncio client, waiting on a BLPOP, can keep
    waiting after it) must not hold the process's shutdown for ever. What is still running then is
    left to the closing of the Redis clients, which ends its command."""
    for task in tasks:
        task.cancel()
    done, pending = await asyncio.wait(tasks, timeout=STOP_WAIT_S)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task %s ended with %r", task.get_name(), task.exception())
    if pending:
        log.warning("%d background task(s) did not stop within %.0f s of the shutdown; closing Redis under them",
                    len(pending), STOP_WAIT_S)


async def _cleanup_forever(retention: Retention, interval_s: float) -> None:
    """Retention in the background: every API process tries each interval, one (a Redis lock) runs it,
    over every project's jobs (the API process's default sees none: core/access/projects.py)."""
    while True:
        try:
            with acting_everywhere():  # the thread-pool call copies this context
                await run_in_threadpool(retention.run_if_due)
        except Exception as exc:
            _stop_if_cancelled()
            # The reason on the ERROR line itself (a log reader without tracebacks sees it); the trace after.
            log.exception("the retention cleanup failed (%s: %s); it runs again in %.0f s", type(exc).__name__,
                          str(exc).splitlines()[0] if str(exc) else "no message", min(interval_s, CLEANUP_RETRY_S))
        await asyncio.sleep(min(interval_s, 60.0))


async def _advance_sweeps_forever(services: Services, interval_s: float) -> None:
    """The sweeps' driver in the background: every API process looks each interval, or at once when
    a worker says a trial's job ended (ty:sweeps:nudge), and one at a time per sweep (a Redis lock)
    tells its ended trials and asks for new ones (core/sweeps/): every project's sweeps, each
    stepped in its own project (`acting_as` in the coordinator)."""
    while True:
        try:
            with acting_everywhere():
                await run_in_threadpool(services.sweeps.advance_all)
        except Exception as exc:
            _stop_if_cancelled()
            log.warning("advancing the sweeps failed (%s: %s); trying again in %.1f s", type(exc).__name__, exc,
                        interval_s)
        try:
            await _nudge_or_tick(services.aredis, interval_s)
        except redis.RedisError:
            _stop_if_cancelled()
            await asyncio.sleep(interval_s)


async def _nudge_or_tick(client: Any, interval_s: float) -> None:
    """Wait for a worker's nudge, `interval_s` at most. The BLPOP runs in a task of its own that a
    shutdown never cancels (the shield): cancelled mid-command, redis-py's asyncio client could keep
    waiting after the cancellation, and the app's shutdown with it. Left alone, it ends by its own
    timeout, or with the client's closing, its outcome read so nothing is logged as lost."""
    nudge = asyncio.ensure_future(client.blpop([keys.SWEEPS_NUDGE], timeout=interval_s))
    nudge.add_done_callback(lambda done: done.cancelled() or done.exception())
    await asyncio.shield(nudge)


class TorchyardApp(FastAPI):
    """FastAPI behind torchyard's edge: the request metrics and the front gate (app/api/front.py)
    run before any layer of FastAPI's, so a request is judged on its headers before a framework
    touches it, and /predict, the hot path, is served by the gate without FastAPI's own middleware
    (its server-error, telemetry and body-limit layers each wrap `send` and `receive`), routing or
    dependencies. Every other request goes on into FastAPI as usual."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.edge: ASGIApp = self.framework  # create_app puts the metrics and the gate in front

    async def framework(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI itself: its middleware, exception handlers, routing."""
        await super().__call__(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self  # as Starlette sets it: what routes and the gate read app.state from
        if scope["type"] != "http":
            await self.edge(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.edge(scope, receive, tracking_send)
        except Exception as exc:
            # What FastAPI's ServerErrorMiddleware did when it was outermost: a bug anywhere in the
            # edge is still a JSON 500 (logged with its trace), and then uvicorn hears of it.
            if not started:
                response = unexpected_error_response(exc, scope["method"], scope["path"], log_trace=True)
                await response(scope, receive, send)
            raise


def create_app(settings: Settings | None = None) -> TorchyardApp:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Outside a request this process sees no project's objects: a path that lost its request's
        # context finds nothing rather than everything (core/access/projects.py). Each request's
        # project is set by the gate; the background tasks below say they act everywhere.
        process_default = fail_closed()
        app.state.services = Services.build(settings)
        app.state.services.predictions.on_orphaned = app.state.metrics.predict_orphaned.inc
        cleanup = asyncio.create_task(_cleanup_forever(app.state.services.retention, settings.cleanup_interval_s))
        sweeping = asyncio.create_task(_advance_sweeps_forever(app.state.services, settings.sweep_tick_s))
        # What is loaded by now lives as long as the process: keep it out of the collector's full
        # passes, which otherwise scan it all and stall every request in flight for the length of a
        # pass each time (the tail latency it cost: docs/benchmarks.md, "Prediction").
        gc.freeze()
        try:
            yield
        finally:
            await _stop_tasks((cleanup, sweeping))
            await app.state.services.close()
            restore_default(process_default)

    # FastAPI's own /docs and /openapi.json would be open to anyone; ours sit behind the API key.
    app = TorchyardApp(title="torchyard", version="1.0.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                       openapi_url=None, description="Train and serve PyTorch image classifiers on your GPUs.")
    install_error_handlers(app)
    # Host, Origin, API key, body size, content type and body rate, on the headers, before routing;
    # the metrics outermost: they count every request, the refused ones too.
    app.edge = metrics.install_metrics(app, FrontGate(app.framework, settings, direct=DIRECT, subtrees=(oip_routes.ROUTE,)))
    app.include_router(health.router)
    dashboard.install_dashboard(app)  # `/` and /static: no data in them, so no key needed
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_assets()), name="docs-assets")  # nor in these
    # The key itself is checked by the front gate; the role table (core/access/roles.py) per route here.
    guarded = [Depends(bearer_scheme), Depends(authorize)]
    refused: dict[int | str, dict[str, Any]] = {403: {"description": "the key's role may not do this "
                                                                     "(docs/security.md)"}}

    @app.get("/openapi.json", include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        # Swagger UI's files from the fastapi-offline wheel, served here: /docs works with no
        # network (FastAPI's default loads them from a CDN, a blank page offline).
        return get_swagger_ui_html(openapi_url="/openapi.json", title="torchyard API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
                                   swagger_ui_parameters={"validatorUrl": None})

    for module in (devices, models, datasets, jobs, predict, metrics, aliases, exports, sweeps, access, projects):
        app.include_router(module.router, dependencies=guarded, responses=refused)
    # The routes as declared, for the front gate to name the route of a request it refuses
    # (FastAPI keeps included routers behind wrappers of its own in app.router.routes).
    app.state.declared_routes = [route for module in (health, devices, models, datasets, jobs, predict, metrics,
                                                      aliases, exports, sweeps, access, projects)
                                  for route in module.router.routes]
    return app
