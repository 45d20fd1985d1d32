from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import ServicesDep
from core.schemas import DeviceList

router = APIRouter(tags=["devices"])


@router.get("/devices", response_model=DeviceList)
def list_devices(services: ServicesDep) -> DeviceList:
    """Every device a live worker holds, from heartbeats; recently seen ones as offline. Another
    project's job on a device shows only as the device's status (`busy`): no id, no resident models."""
    return DeviceList(devices=services.devices.seen())
