"""The host staging ring (worker/device/pinned_ring.py) on the CPU, as training and serving use it:
slots handed out in turn, and a copy to the device that a later use of its slot cannot change."""

from __future__ import annotations

import torch

from worker.device.pinned_ring import PinnedRing, copies_run_behind


def test_slots_come_round_in_turn_and_a_copy_outlives_its_slot() -> None:
    device = torch.device("cpu")
    assert not copies_run_behind(device)
    made: list[bool] = []

    def make(pinned: bool) -> torch.Tensor:
        made.append(pinned)
        return torch.zeros(4, dtype=torch.uint8)

    ring = PinnedRing(make, device, count=2)
    assert made == [False, False]  # nothing pinned where copies cannot run behind
    first, second = ring.next(), ring.next()
    assert first is not second and ring.next() is first  # the third use comes back to the first slot
    first.fill_(7)
    copy = ring.to_device(first)
    ring.copies_issued()
    ring.next()
    ring.next().fill_(9)  # the same slot, reused
    assert copy.tolist() == [7, 7, 7, 7] and first.tolist() == [9, 9, 9, 9]
    assert ring.copied == [None, None]  # no events on the CPU
