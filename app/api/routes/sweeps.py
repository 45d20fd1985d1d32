"""Sweeps (core/sweeps/): a hyper-parameter search whose trials are training jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response
from sse_starlette import EventSourceResponse

from app.api.deps import ServicesDep
from app.api.sse import parse_last_event_id, sweep_event_response
from core.sweeps.spec import Sweep, SweepList, SweepSpec

router = APIRouter(tags=["sweeps"])


@router.post("/sweeps", status_code=201, response_model=Sweep,
             responses={200: {"description": "An earlier request with this Idempotency-Key", "model": Sweep},
                        422: {"description": "a field of the sweep or of its base job refused (the field is named), "
                                             "or an Idempotency-Key already used for another body"}})
def create_sweep(services: ServicesDep, spec: SweepSpec, response: Response,
                 idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> Sweep:
    """Start a search: `trials` training jobs of `base` with the fields of `space` chosen by Optuna's
    sampler, `parallel` at a time, the pruner judging each epoch's `metric`."""
    sweep, created = services.sweeps.create(spec, idempotency_key)
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/sweeps/{sweep.id}"
    return sweep


@router.get("/sweeps", response_model=SweepList)
def list_sweeps(services: ServicesDep, limit: Annotated[int, Query(ge=1, le=100)] = 20) -> SweepList:
    """The newest sweeps first, each with its trials and best trial."""
    return SweepList(sweeps=services.sweeps.page(limit))


@router.get("/sweeps/{sweep_id}", response_model=Sweep, responses={404: {"description": "no such sweep"}})
def get_sweep(services: ServicesDep, sweep_id: str) -> Sweep:
    """A sweep's status, every trial (job, params, state, value, epoch reached), the best trial and,
    once it has ended, each parameter's importance."""
    return services.sweeps.get(sweep_id)


@router.post("/sweeps/{sweep_id}/cancel", status_code=202, response_model=Sweep,
             responses={404: {"description": "no such sweep"}, 409: {"description": "the sweep has already ended"}})
def cancel_sweep(services: ServicesDep, sweep_id: str) -> Sweep:
    """No trial is asked after this; the running trials' jobs are cancelled."""
    return services.sweeps.cancel(sweep_id)


@router.delete("/sweeps/{sweep_id}", status_code=204,
               responses={404: {"description": "no such sweep"},
                          409: {"description": "still running (cancel it first)"}})
def delete_sweep(services: ServicesDep, sweep_id: str) -> Response:
    """An ended sweep's record and events; its trials' jobs stay (DELETE /jobs/{id} each)."""
    services.sweeps.delete(sweep_id)
    return Response(status_code=204)


@router.get("/sweeps/{sweep_id}/events", response_class=EventSourceResponse,
            responses={200: {"content": {"text/event-stream": {}}},
                       404: {"description": "no such sweep"},
                       422: {"description": "a Last-Event-ID that is not a stream id"}})
def sweep_events(services: ServicesDep, sweep_id: str,
                 last_event_id: Annotated[str | None, Header()] = None) -> EventSourceResponse:
    """Server-sent events: each trial as it is created and told, and the sweep's status; resumes
    after `Last-Event-ID`."""
    services.sweeps.records.get(sweep_id)  # 404 before the stream starts
    last_event_id = parse_last_event_id(last_event_id)
    return sweep_event_response(services.aredis, sweep_id, last_event_id)
