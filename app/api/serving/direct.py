"""POST /predict as the front gate serves it: a plain ASGI app, past FastAPI's routing.

The gate (app/api/front.py) has checked the Host, the key, the size and the content type on the
headers; this calls the engine (app/api/serving/engine.PredictionClient.answer) and sends its
answer as the two ASGI messages themselves. The same answers and the same errors as the FastAPI
route that declares /predict for OpenAPI (app/api/routes/predict.py), without FastAPI's routing
and dependency layers, a large share of the API's CPU per prediction (docs/benchmarks.md).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from app.api.errors import known_error_response, unexpected_error_response
from app.api.front import DirectRoute


async def serve(scope: Scope, receive: Receive, send: Send) -> None:
    request = Request(scope, receive)
    try:
        body = await request.app.state.services.predictions.answer(request)
    except Exception as exc:
        response = known_error_response(exc) or unexpected_error_response(exc, "POST", "/predict", log_trace=True)
        await response(scope, receive, send)
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


DIRECT = {("POST", "/predict"): DirectRoute("/predict", serve)}
