"""The Open Inference Protocol's documents (KServe v2 REST, as Triton serves it), as pydantic models.

Written here rather than taken from a package: `open-inference-openapi` is pydantic v1, and both
it and `kserve` require a tensor's `data`, which the binary tensor extension leaves out (its bytes
follow the JSON), so a binary request would fail their validation (/work/shared/real-components.md
measured both). Only what torchyard serves is modelled; unknown fields of a request are ignored,
as Triton ignores them.

The names the protocol fixes: INPUT__0 (FP32, preprocessed as exports take it), IMAGE (BYTES:
encoded image files), OUTPUT__0 (FP32 probabilities); the datatypes' Triton config spellings
(TYPE_FP32, TYPE_STRING) are what perf_analyzer reads from GET …/config.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

INPUT_TENSOR = "INPUT__0"
INPUT_IMAGE = "IMAGE"
OUTPUT_PROBABILITIES = "OUTPUT__0"
FP32 = "FP32"
BYTES = "BYTES"
CONFIG_TYPES = {FP32: "TYPE_FP32", BYTES: "TYPE_STRING"}
EXTENSIONS = ["binary_tensor_data", "classification", "model_repository", "statistics", "model_configuration"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestInput(_Lenient):
    name: str = Field(max_length=256)
    shape: list[int] = Field(max_length=8)
    datatype: str = Field(max_length=16)
    parameters: dict[str, Any] | None = None
    data: Any = None  # a flat or nested list (JSON tensors); absent with the binary extension


class RequestOutput(_Lenient):
    name: str = Field(max_length=256)
    parameters: dict[str, Any] | None = None


class InferenceRequest(_Lenient):
    id: str | None = Field(default=None, max_length=256)
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput] = Field(min_length=1, max_length=16)
    outputs: list[RequestOutput] | None = Field(default=None, max_length=16)


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 for the batch dimension.")
    parameters: dict[str, Any] | None = None


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: dict[str, Any] | None = None


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ConfigTensor(BaseModel):
    """A tensor in Triton's model configuration: `dims` without the batch dimension."""

    name: str
    data_type: str
    dims: list[int]
    optional: bool | None = None


class ModelConfig(BaseModel):
    """GET …/config: Triton's model configuration, the fields perf_analyzer and gateways read."""

    name: str
    platform: str
    backend: str
    version_policy: dict[str, Any]
    max_batch_size: int
    input: list[ConfigTensor]
    output: list[ConfigTensor]
    dynamic_batching: dict[str, Any]
    parameters: dict[str, Any]


class Duration(BaseModel):
    count: int = 0
    ns: int = 0


class InferStats(BaseModel):
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    cache_hit: Duration
    cache_miss: Duration


class ModelStats(BaseModel):
    name: str
    version: str
    last_inference: int = Field(description="ms since the epoch.")
    inference_count: int
    execution_count: int
    inference_stats: InferStats
    batch_stats: list[Any] = []


class ModelStatsList(BaseModel):
    model_stats: list[ModelStats]


class RepositoryEntry(BaseModel):
    name: str
    version: str
    state: str
    reason: str = ""


class ErrorBody(BaseModel):
    error: str
