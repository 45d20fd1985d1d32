"""The protocol's endpoints answered: paths → the catalog, the statistics, the inference (app/api/oip/).

`OpenInference.respond` is what app/api/oip/routes.py serves; each answer is (status, body, headers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson
import redis
from pydantic import BaseModel
from starlette.requests import Request

from app.api.oip.catalog import ModelCatalog, ModelRef
from app.api.oip.infer import Inference
from app.api.oip.protocol import (
    BYTES,
    CONFIG_TYPES,
    EXTENSIONS,
    FP32,
    INPUT_IMAGE,
    INPUT_TENSOR,
    OUTPUT_PROBABILITIES,
    ConfigTensor,
    ModelConfig,
    ModelMetadata,
    ModelStatsList,
    RepositoryEntry,
    ServerMetadata,
    TensorMetadata,
)
from app.api.oip.stats import InferenceStats
from app.api.serving.engine import PredictionClient
from core.config import Settings
from core.errors import NotFound

PREFIX = "/v2"
SERVER_NAME = "torchyard"
SERVER_VERSION = "1.0.0"
PLATFORM = "pytorch_libtorch"
_MODEL = re.compile(r"^/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?(?:/(?P<action>ready|config|stats|infer))?$")


@dataclass
class OpenInference:
    """What the endpoints need: the catalog of models, the counters, the engine shared with /predict."""

    catalog: ModelCatalog
    stats: InferenceStats
    inference: Inference
    engine: PredictionClient
    max_batch: int

    @classmethod
    def build(cls, engine: PredictionClient, settings: Settings) -> OpenInference:
        catalog, stats = ModelCatalog(engine.redis), InferenceStats()
        inference = Inference(engine, catalog, stats, max_items=settings.max_images_per_request,
                              max_image_bytes=settings.max_image_bytes, max_pixels=settings.max_image_pixels,
                              max_body_bytes=settings.max_predict_request_bytes,
                              max_json_bytes=settings.oip_max_json_bytes)
        return cls(catalog, stats, inference, engine, settings.max_images_per_request)

    async def respond(self, request: Request) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        path, method = request.scope["path"].rstrip("/") or "/", request.scope["method"]
        if method == "GET" and path == PREFIX:
            return _json(ServerMetadata(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS))
        if method == "GET" and path == f"{PREFIX}/health/live":
            return 200, b"", []
        if method == "GET" and path == f"{PREFIX}/health/ready":
            return (200 if await self._server_ready() else 400), b"", []
        if method == "POST" and path == f"{PREFIX}/repository/index":
            entries = [RepositoryEntry(name=n, version=v, state="READY" if ready else "UNAVAILABLE",
                                       reason="" if ready else "the job has not succeeded").model_dump()
                       for n, v, ready in await self.catalog.index()]
            return 200, orjson.dumps(entries), [(b"content-type", b"application/json")]
        if method == "GET" and path == f"{PREFIX}/models/stats":
            return _json(ModelStatsList(model_stats=self.stats.every()))
        match = _MODEL.match(path)
        if match is None:
            raise NotFound(f"{method} {path[:200]} is not an endpoint of the protocol")
        name, version, action = match["name"], match["version"], match["action"]
        if action == "infer" and method == "POST":
            body, header_length = await self.inference.answer(request, name, version)
            if header_length is None:
                return 200, body, [(b"content-type", b"application/json")]
            return 200, body, [(b"content-type", b"application/octet-stream"),
                               (b"inference-header-content-length", str(header_length).encode())]
        if method != "GET" or action == "infer":
            raise NotFound(f"{method} {path[:200]} is not an endpoint of the protocol")
        ref = await self.catalog.resolve(name, version)
        if action is None:
            return _json(self._metadata(ref))
        if action == "ready":
            return (200 if ref.info.ready else 400), b"", []
        if action == "config":
            return _json(self._config(ref))
        versions = [version] if version is not None else [str(i + 1) for i in range(len(ref.versions))]
        return _json(ModelStatsList(model_stats=self.stats.of(name, versions)))

    async def _server_ready(self) -> bool:
        try:
            return bool(await self.engine.live.read())
        except redis.RedisError:
            return False

    @staticmethod
    def _metadata(ref: ModelRef) -> ModelMetadata:
        info = ref.info
        classes = len(info.classes)
        return ModelMetadata(
            name=ref.name, versions=[str(i + 1) for i in range(len(ref.versions))], platform=PLATFORM,
            inputs=[TensorMetadata(name=INPUT_TENSOR, datatype=FP32, shape=[-1, *info.shape],
                                   parameters={"range": [0.0, 1.0], "layout": "NCHW",
                                               "preprocessing": "as exports take it: docs/deploying-models.md"}),
                    TensorMetadata(name=INPUT_IMAGE, datatype=BYTES, shape=[-1, 1],
                                   parameters={"content": "encoded image files (JPEG, PNG, ...), decoded as /predict"})],
            outputs=[TensorMetadata(name=OUTPUT_PROBABILITIES, datatype=FP32, shape=[-1, classes],
                                    parameters={"kind": "probabilities (softmax applied)",
                                                "classes": list(info.classes)})],
            parameters={"job_id": info.job_id, "architecture": info.architecture, "version": ref.version})

    def _config(self, ref: ModelRef) -> ModelConfig:
        info = ref.info
        return ModelConfig(
            name=ref.name, platform=PLATFORM, backend="pytorch", version_policy={"latest": {"num_versions": 1}},
            max_batch_size=self.max_batch,
            input=[ConfigTensor(name=INPUT_TENSOR, data_type=CONFIG_TYPES[FP32], dims=list(info.shape), optional=True),
                   ConfigTensor(name=INPUT_IMAGE, data_type=CONFIG_TYPES[BYTES], dims=[1], optional=True)],
            output=[ConfigTensor(name=OUTPUT_PROBABILITIES, data_type=CONFIG_TYPES[FP32], dims=[len(info.classes)])],
            dynamic_batching={}, parameters={"job_id": {"string_value": info.job_id}})


def _json(document: BaseModel) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    return 200, document.model_dump_json(exclude_none=True).encode(), [(b"content-type", b"application/json")]


