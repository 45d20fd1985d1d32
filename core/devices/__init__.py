"""The devices: which exist and which are alive (the registry), and what each is doing (its slot).

- `registry`: each worker's device record and its alive key (a TTL that only its owning worker
  instance refreshes: the device lock), written from the heartbeat thread; what GET /devices and
  the API's /predict path read, and why a queued job waits;
- `slots`: what a device's worker is doing (busy, reserved for a gang's rank, held for a waiting
  gang), taken and released by every task; the gangs' side of them is core/gangs/.
"""

from core.devices.registry import (
    SERVING,
    DeviceRegistry,
    alive_instances,
    devices_from_replies,
    instance_pid,
    liveness_reads,
    new_instance,
)
from core.devices.slots import DeviceSlots, SlotState, slot_states

__all__ = ["SERVING", "DeviceRegistry", "DeviceSlots", "SlotState", "alive_instances", "devices_from_replies",
           "instance_pid", "liveness_reads", "new_instance", "slot_states"]
