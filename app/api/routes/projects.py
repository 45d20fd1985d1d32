"""A project's quotas and what it uses (core/access/quotas.py): an admin sets them, its members
read them. Another project's is a 404 for a key of another project, as its objects are."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from app.api.deps import ServicesDep
from core.access.models import PROJECT_PATTERN, ProjectView, Quota
from core.access.projects import visible
from core.errors import NotFound

router = APIRouter(tags=["projects"])
ProjectName = Annotated[str, Path(pattern=PROJECT_PATTERN, description="lowercase letters, digits, - and _")]


@router.put("/projects/{name}", response_model=ProjectView, responses={422: {"description": "invalid quota"}})
def set_quota(services: ServicesDep, name: ProjectName, body: Quota) -> ProjectView:
    """Set the project's quotas (each null for none); it need not have objects yet. Admin only."""
    services.quotas.set(name, body)
    return services.quotas.view(name)


@router.get("/projects/{name}", response_model=ProjectView,
            responses={404: {"description": "a project other than the key's"}})
def get_project(services: ServicesDep, name: ProjectName) -> ProjectView:
    """The project's quotas and its use of them now: queued and running jobs, uploads and their bytes."""
    if not visible(name):
        raise NotFound(f"project {name} not found")
    return services.quotas.view(name)
