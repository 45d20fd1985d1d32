"""An API process fails closed: outside a request (a code path that lost the request's context, a
thread started by hand) its stores see no project's objects and may make none, while the gate sets
each request's project and the background tasks that must see everything say so
(core/access/projects.py). The app here is the real one, built by its factory with its lifespan
run and requests sent through httpx's ASGI transport, against a real Redis."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from app.main import create_app
from core.access.projects import EVERYWHERE, NoActingProject, acting, acting_as, acting_everywhere, home
from core.config import Settings
from core.errors import NotFound
from core.schemas import JobStatus
from tests.core.kinds.examples import train_params

KEY = "acting-default-test-key"


def test_outside_a_request_the_api_process_sees_nothing(clean_redis_url: str, tmp_path: Path) -> None:
    settings = Settings(
        _env_file=None,
        redis_url=clean_redis_url,
        data_dir=tmp_path,
        api_key=KEY,
    )
    app = create_app(settings)
    assert acting() is EVERYWHERE  # building the app changes nothing: its lifespan does
    asyncio.run(_outside_and_inside_requests(app))
    assert acting() is EVERYWHERE  # the app stopped: this process's default is back


async def _outside_and_inside_requests(app: FastAPI) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http,
    ):
        jobs = app.state.services.jobs
        with acting_as("alpha"):  # as a request of project alpha would make it
            job, created = jobs.create(
                model="cifar_net", dataset="fake", params=train_params(epochs=1), requested_device="cpu"
            )
        assert created and job.project == "alpha"

        # No request's context: not found, not listed, and nothing may be made.
        with pytest.raises(NotFound):
            jobs.get(job.id)
        assert jobs.page(JobStatus.queued).jobs == []
        with pytest.raises(NoActingProject):
            home()
        seen: list[object] = []

        def by_hand() -> None:  # a thread started by hand has no context at all
            try:
                seen.append(jobs.get(job.id))
            except NotFound as exc:
                seen.append(exc)

        thread = threading.Thread(target=by_hand)
        thread.start()
        thread.join()
        assert len(seen) == 1 and isinstance(seen[0], NotFound)

        # A request gets its project from the gate: the bootstrap admin key sees every project.
        answer = await http.get(f"/jobs/{job.id}", headers=auth)
        assert answer.status_code == 200 and answer.json()["project"] == "alpha"
        listed = (await http.get("/jobs", headers=auth)).json()["jobs"]
        assert [j["id"] for j in listed] == [job.id]
        assert (await http.get(f"/jobs/{job.id}?project=beta", headers=auth)).status_code == 404

        # What the background tasks use says it acts everywhere, or for one project.
        with acting_everywhere():
            assert jobs.get(job.id).id == job.id
        with acting_as("alpha"):
            assert jobs.get(job.id).id == job.id
        with acting_as("beta"), pytest.raises(NotFound):
            jobs.get(job.id)
