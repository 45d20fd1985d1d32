"""GET /metrics (Prometheus text format) and the middleware that counts requests by route template."""

from __future__ import annotations

import time

from fastapi import APIRouter, FastAPI, Request, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.metrics import CONTENT_TYPE, ClusterSource, Metrics, multiprocess_dir

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
def metrics(request: Request) -> Response:
    """Requests, /predict latency, queue depths, jobs by status, devices, batch sizes, images/s."""
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE)


class RequestMetricsMiddleware:
    """Pure ASGI (never buffers a streamed response): counts each request under its route
    *template* (`/jobs/{job_id}`), so ids never explode the label set; unrouted paths count as
    `unmatched`."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception that escapes the app ends as a 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.observe_request(scope["method"], route, status, time.perf_counter() - started)


def install_metrics(app: FastAPI, inner: ASGIApp) -> RequestMetricsMiddleware:
    """The app's registry (app.state.metrics) and cluster collector, and the request middleware
    around `inner`, returned for the caller to serve. The /metrics router itself is included with
    the other protected routers. Several API processes (PROMETHEUS_MULTIPROC_DIR set by their
    parent): each scrape sums them all."""
    metrics = Metrics(multiprocess_dir())
    app.state.metrics = metrics

    def source() -> ClusterSource | None:
        services = getattr(app.state, "services", None)
        return ClusterSource(services.redis, services.devices) if services else None

    metrics.watch_cluster(source)
    return RequestMetricsMiddleware(inner, metrics)
