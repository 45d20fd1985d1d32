"""A typed Python client for the torchyard HTTP API (docs/api.md), on httpx.

It is what `torchyard train/jobs/predict/...` use, and usable on its own::

    from client.sdk import TorchyardClient

    with TorchyardClient("http://gpu-box:8000", api_key="...") as ty:
        job = ty.submit(model="cifar_net", dataset="fake", epochs=3)
        for event in ty.events(job.id):
            print(event.kind, event.data)
        print(ty.predict(job.id, ["examples/pattern_3.png"]).results[0].predictions[0].label)

Every non-2xx answer raises `ApiError` carrying the API's `detail`, and an unreachable server
raises `ApiError` with `status=None`, so callers handle one exception type.
"""

from __future__ import annotations

import hashlib
import mimetypes
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote

import httpx
from httpx_sse import connect_sse

from client.events import Event, Waiting, parse_event
from client.http import ApiError, error_detail
from client.teams import TeamCalls
from core.defaults import TOP_K
from core.schemas import (
    Alias,
    AliasHistory,
    AliasUpdate,
    Device,
    Evaluation,
    Job,
    JobList,
    ModelInfo,
    PredictResponse,
)

T = TypeVar("T")


def zip_directory(directory: Path, target: IO[bytes]) -> int:
    """Write an ImageFolder directory (`<class>/<image>`) as a zip; returns the number of files."""
    count = 0
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED) as archive:
        for path in sorted(directory.rglob("*")):
            if path.is_file() and not any(part.startswith(".") for part in path.relative_to(directory).parts):
                archive.write(path, path.relative_to(directory).as_posix())
                count += 1
    return count


class TorchyardClient(TeamCalls):
    """One connection pool to one torchyard server. Use as a context manager, or call close().
    The keys', projects' and sweeps' calls are its base's (client/teams.py), the connection and
    `ApiError` client/http.py's."""

    # ------------------------------------------------------------------ reading
    def health(self) -> dict[str, Any]:
        return self._request("GET", "/healthz").json()

    def devices(self) -> list[Device]:
        return [Device.model_validate(d) for d in self._request("GET", "/devices").json()["devices"]]

    def models(self) -> list[ModelInfo]:
        return [ModelInfo.model_validate(m) for m in self._request("GET", "/models").json()["models"]]

    def datasets(self) -> list[dict[str, Any]]:
        return self._request("GET", "/datasets").json()["datasets"]

    def jobs(self, status: str | None = None, limit: int = 50, cursor: str | None = None) -> JobList:
        params = {k: v for k, v in {"status": status, "limit": limit, "cursor": cursor}.items() if v is not None}
        return JobList.model_validate(self._request("GET", "/jobs", params=params).json())

    def job(self, job_id: str) -> Job:
        return Job.model_validate(self._request("GET", f"/jobs/{job_id}").json())

    def metrics_text(self) -> str:
        return self._request("GET", "/metrics").text

    # ------------------------------------------------------------------ writing
    def submit(self, *, model: str, dataset: str, idempotency_key: str | None = None, **params: Any) -> Job:
        """POST /jobs; parameters left as None take the server's defaults."""
        body = {"model": model, "dataset": dataset, **{k: v for k, v in params.items() if v is not None}}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return Job.model_validate(self._request("POST", "/jobs", json=body, headers=headers).json())

    def evaluate(self, job_id: str, dataset: str, *, device: str | None = None,
                 batch_size: int | None = None) -> Evaluation:
        """POST /jobs/{id}/evaluate: queue an evaluation of the job's checkpoint on `dataset` (an id or
        a name: its newest version). The evaluation is itself a job (`Evaluation.id`): follow it with events()."""
        body = {k: v for k, v in {"dataset": dataset, "device": device, "batch_size": batch_size}.items()
                if v is not None}
        return Evaluation.model_validate(self._request("POST", f"/jobs/{job_id}/evaluate", json=body).json())

    def submit_predictions(self, dataset: str, *, job_id: str | None = None, alias: str | None = None,
                           top_k: int = TOP_K, batch_size: int | None = None, device: str | None = None,
                           idempotency_key: str | None = None) -> Job:
        """POST /jobs with kind predict: a succeeded job's model (or an alias's) over every image of an
        uploaded dataset. The job's file is `download_results` once it succeeded; follow it with events()."""
        body = {"kind": "predict", "job_id": job_id, "alias": alias, "dataset": dataset, "top_k": top_k,
                "batch_size": batch_size, "device": device}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return Job.model_validate(self._request("POST", "/jobs", json={k: v for k, v in body.items() if v is not None},
                                                headers=headers).json())

    def download_results(self, job_id: str, target: str | Path) -> tuple[Path, str]:
        """Stream a succeeded predict job's JSON lines to `target` (beside it, then renamed), checked
        against the sha256 the server recorded. Returns (path, sha256)."""
        return self._download(f"/jobs/{job_id}/results", target, "X-Results-SHA256", f"results of {job_id}")

    def evaluation(self, job_id: str, evaluation_id: str) -> Evaluation:
        return Evaluation.model_validate(self._request("GET", f"/jobs/{job_id}/evaluations/{evaluation_id}").json())

    def cancel(self, job_id: str) -> Job:
        return Job.model_validate(self._request("POST", f"/jobs/{job_id}/cancel").json())

    def delete(self, what: str, ref: str) -> None:
        """DELETE a job (`what="jobs"`, by id) or a dataset (`"datasets"`, by id or name: its newest version)."""
        self._request("DELETE", f"/{what}/{quote(ref, safe='')}")

    def upload_dataset(self, path: str | Path, name: str | None = None, *, labeled: bool = True,
                       new_version: bool = False) -> dict[str, Any]:
        """Upload an ImageFolder zip, or a directory that is zipped here first (in a temp file).
        `labeled=False`: images at any depth without class folders (for predict jobs only);
        `new_version`: the next version of the dataset named `name` (else a taken name is a 409)."""
        path = Path(path)
        data = {"name": name} if name else {}
        data.update({"labels": "none"} if not labeled else {}, **({"new_version": "true"} if new_version else {}))
        if path.is_dir():
            with tempfile.TemporaryFile() as archive:
                if zip_directory(path, archive) == 0:
                    raise ApiError(None, f"{path} has no files to upload")
                archive.seek(0)
                files = {"file": (f"{path.name or 'dataset'}.zip", archive, "application/zip")}
                return self._request("POST", "/datasets", files=files, data=data).json()
        if not path.is_file():
            raise ApiError(None, f"{path}: no such file or directory")
        with path.open("rb") as handle:
            return self._request("POST", "/datasets", files={"file": (path.name, handle, "application/zip")},
                                 data=data).json()

    def predict(self, job_id: str | None, images: Sequence[str | Path], top_k: int = TOP_K, *,
                alias: str | None = None) -> PredictResponse:
        """Classify images with a job's model, or (job_id=None, alias="pets") with an alias's."""
        handles = []
        try:
            files = []
            for image in images:
                path = Path(image)
                try:
                    handle = path.open("rb")
                except OSError as exc:
                    raise ApiError(None, f"{path}: {exc.strerror}") from exc
                handles.append(handle)
                kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
                files.append(("file", (path.name, handle, kind)))
            target = {"alias": alias} if alias is not None else {"job_id": job_id or ""}
            response = self._request("POST", "/predict", files=files, data={**target, "top_k": str(top_k)})
        finally:
            for handle in handles:
                handle.close()
        return PredictResponse.model_validate(response.json())

    def download_checkpoint(self, job_id: str, target: str | Path) -> tuple[Path, str]:
        """Stream the weights to `target` (written beside it, then renamed) and check the sha256."""
        return self._download(f"/jobs/{job_id}/checkpoint", target, "X-Checkpoint-SHA256", f"checkpoint of {job_id}")

    def _download(self, url: str, target: str | Path, sha_header: str, what: str) -> tuple[Path, str]:
        got = self._fetch(url, target, sha_header, what)
        if isinstance(got, _Pending):
            raise ApiError(202, f"{what} is not ready yet")
        return got

    def _fetch(self, url: str, target: str | Path, sha_header: str, what: str,
               params: dict[str, Any] | None = None) -> tuple[Path, str] | _Pending:
        """Stream `url` to `target` (written beside it, then renamed), checked against the sha256 in
        `sha_header`: (path, sha256). A 202 (an export being built) writes nothing: `_Pending`."""
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        digest = hashlib.sha256()
        try:
            with self._http.stream("GET", url, params=params) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ApiError(response.status_code, error_detail(response))
                if response.status_code == 202:
                    response.read()
                    return _Pending(float(response.headers.get("Retry-After") or 2), response.headers.get("Location"))
                with partial.open("wb") as out:
                    for chunk in response.iter_bytes(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                expected = response.headers.get(sha_header)
        except httpx.TransportError as exc:
            partial.unlink(missing_ok=True)
            raise ApiError(None, f"cannot reach torchyard at {self.url}: {exc}") from exc
        if expected and expected != digest.hexdigest():
            partial.unlink(missing_ok=True)
            raise ApiError(None, f"{what} arrived corrupted (sha256 mismatch)")
        partial.replace(target)
        return target, digest.hexdigest()

    # ------------------------------------------------------------------ aliases
    def aliases(self) -> list[Alias]:
        return [Alias.model_validate(a) for a in self._request("GET", "/aliases").json()["aliases"]]

    def alias(self, name: str) -> Alias:
        return Alias.model_validate(self._request("GET", f"/aliases/{name}").json())

    def set_alias(self, name: str, job_id: str, note: str | None = None) -> AliasUpdate:
        """Point `name` at a succeeded job (warmed where the old target is resident, then moved)."""
        body = {"job_id": job_id, **({"note": note} if note else {})}
        return AliasUpdate.model_validate(self._request("PUT", f"/aliases/{name}", json=body).json())

    def rollback_alias(self, name: str, note: str | None = None) -> AliasUpdate:
        body = {"note": note} if note else None
        return AliasUpdate.model_validate(self._request("POST", f"/aliases/{name}/rollback", json=body).json())

    def alias_history(self, name: str, limit: int = 100) -> AliasHistory:
        return AliasHistory.model_validate(
            self._request("GET", f"/aliases/{name}/history", params={"limit": limit}).json())

    def delete_alias(self, name: str, note: str | None = None) -> None:
        self._request("DELETE", f"/aliases/{name}", params={"note": note} if note else None)

    # ------------------------------------------------------------------ exports
    def export(self, job_id: str, fmt: str, target: str | Path, *, timeout: float = 600.0,
               retry: bool = False) -> tuple[Path, str]:
        """Download a job's model as `fmt` (torchscript | onnx), waiting while a worker builds it
        (202 + Retry-After), checked against X-Export-SHA256. Returns (path, sha256)."""
        deadline = time.monotonic() + timeout
        params: dict[str, Any] = {"format": fmt, **({"retry": "true"} if retry else {})}
        while True:
            got = self._fetch(f"/jobs/{job_id}/export", target, "X-Export-SHA256", f"the {fmt} export of {job_id}",
                              params=params)
            if not isinstance(got, _Pending):
                return got
            if time.monotonic() + got.retry_after_s > deadline:
                raise ApiError(None, f"the {fmt} export of {job_id} was not ready within {timeout:g}s "
                                     f"(export job {got.location})")
            params.pop("retry", None)  # one rebuild was asked for; now wait for it
            time.sleep(got.retry_after_s)

    # ------------------------------------------------------------------ following
    def events(self, job_id: str, *, reconnect: bool = True,
               on_wait: Callable[[str | None], None] | None = None) -> Iterator[Event]:
        """A job's server-sent events until its terminal status.

        The stream rides out what ends while the job goes on: a dropped connection, an API that is
        restarting (refused connections) or answers 502/503/504 (its Redis is away). It reconnects
        with Last-Event-ID, so no event is lost or repeated, backing off up to RECONNECT_MAX_S, for
        as long as it takes: it ends only with the job (or the caller, Ctrl-C). `on_wait(reason)` is
        called once when the waiting starts, `on_wait(None)` once when the stream is back.
        `reconnect=False`: the first failure raises ApiError instead."""
        last_id: str | None = None
        wait = Waiting(on_wait)
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                with connect_sse(self._http, "GET", f"/jobs/{job_id}/events", headers=headers,
                                 timeout=httpx.Timeout(10.0, read=60.0)) as source:
                    if source.response.status_code >= 400:
                        source.response.read()
                        raise ApiError(source.response.status_code, error_detail(source.response))
                    wait.over()
                    for sse in source.iter_sse():
                        event = parse_event(sse)
                        if event is None:
                            continue
                        last_id = event.id or last_id
                        yield event
                        if event.terminal:
                            return
                # The server closed the stream without a terminal event (its Redis went away, or
                # the job had ended before our Last-Event-ID): the job record says where it stands.
                if not reconnect or self.job(job_id).status.terminal:
                    return
            except httpx.TransportError as exc:
                if not reconnect:
                    raise ApiError(None, f"lost the event stream of {job_id}: {exc}") from exc
                wait.start(f"cannot reach torchyard at {self.url}")
            except ApiError as exc:
                if not reconnect or not exc.retriable:
                    raise
                wait.start(str(exc))
            time.sleep(wait.next_pause())

    def patiently(self, call: Callable[[], T], on_wait: Callable[[str | None], None] | None = None) -> T:
        """`call()`, retried while the API cannot be reached or answers 502/503/504 (a restart, a
        Redis outage), backing off as `events` does; any other error is raised at once."""
        wait = Waiting(on_wait)
        while True:
            try:
                result = call()
            except ApiError as exc:
                if not exc.retriable:
                    raise
                wait.start(str(exc))
                time.sleep(wait.next_pause())
                continue
            wait.over()
            return result


@dataclass(frozen=True)
class _Pending:
    """A 202: what is asked for is being built (an export); ask again after `retry_after_s`."""

    retry_after_s: float
    location: str | None
