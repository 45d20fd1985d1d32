"""The inference engine's batching decisions and its staging, run on the CPU exactly as a GPU worker
runs them (CI has no GPU): the window, the bucketed sizes, the staging buffers' rotation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.serving.batching import BatchWindow, HostStaging, bucket_size, buckets

WAIT = 0.002


def test_a_lone_request_on_a_quiet_device_goes_at_once() -> None:
    window = BatchWindow(max_batch=32, max_wait_s=WAIT)
    assert window.ready(1, opened_at=100.0, now=100.0, device_busy=False)
    window.observe(1)
    assert window.ready(1, opened_at=101.0, now=101.0, device_busy=False)


def test_under_load_the_window_waits_for_the_expected_batch_then_follows_traffic_down() -> None:
    window = BatchWindow(max_batch=32, max_wait_s=WAIT)
    window.observe(20)  # collected while the device was busy: 20 clients are out there
    assert window.target() == 20
    assert not window.ready(5, opened_at=100.0, now=100.001, device_busy=False)
    assert window.ready(20, opened_at=100.0, now=100.001, device_busy=False)
    window.observe(32)
    assert window.target() == 32
    # the window runs out with 3: the next batch expects 3, so a lone client is delayed only once
    assert window.ready(3, opened_at=100.0, now=100.0 + WAIT, device_busy=False)
    window.observe(3)
    assert window.target() == 3
    window.observe(1)
    assert window.ready(1, opened_at=200.0, now=200.0, device_busy=False)


def test_while_the_device_is_busy_the_intake_keeps_collecting_up_to_max_batch() -> None:
    window = BatchWindow(max_batch=32, max_wait_s=WAIT)
    assert not window.ready(1, opened_at=100.0, now=105.0, device_busy=True)  # long past the window
    assert not window.ready(31, opened_at=100.0, now=105.0, device_busy=True)
    assert window.ready(32, opened_at=100.0, now=100.0, device_busy=True)
    window.observe(40)  # a request with several images can overshoot: the target stays capped
    assert window.target() == 32


def test_a_batch_never_waits_longer_than_the_device_takes_to_compute_one() -> None:
    window = BatchWindow(max_batch=32, max_wait_s=0.010)
    window.observe(32)
    assert window.wait_s() == 0.010  # no forward timed yet: the configured window
    assert not window.ready(10, opened_at=100.0, now=100.005, device_busy=False)
    window.note_forward(0.002, 32)  # a light model: its full batch computes in 2 ms
    assert window.wait_s() == pytest.approx(0.002)
    assert not window.ready(10, opened_at=100.0, now=100.001, device_busy=False)
    assert window.ready(10, opened_at=100.0, now=100.002, device_busy=False)
    assert window.deadline(100.0) == pytest.approx(100.002)
    window.note_forward(0.0001, 4)  # fewer than expected: says nothing of what a full batch costs
    assert window.wait_s() == pytest.approx(0.002)
    for _ in range(40):  # a heavy model: the configured window bounds the wait again
        window.note_forward(0.030, 32)
    assert window.wait_s() == 0.010
    assert not window.ready(10, opened_at=100.0, now=100.005, device_busy=False)
    assert not window.ready(31, opened_at=100.0, now=105.0, device_busy=True)  # a busy device: collect on


@pytest.mark.parametrize(("n", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (31, 32), (32, 32),
                                           (33, 33)])
def test_batch_sizes_are_bucketed_to_powers_of_two_up_to_max_batch(n: int, bucket: int) -> None:
    assert bucket_size(n, 32) == bucket
    assert bucket_size(5, 6) == 6  # max_batch is a bucket of its own
    assert buckets(32) == [1, 2, 4, 8, 16, 32] and buckets(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        bucket_size(0, 32)


def test_staging_pads_rotates_and_never_hands_out_its_own_buffer() -> None:
    staging = HostStaging(torch.device("cpu"), capacity=8)
    arrays = [np.full((3, 4, 4), i, dtype=np.uint8) for i in range(1, 4)]
    first = staging.upload(arrays, rows=4)
    assert first.shape == (4, 3, 4, 4) and first.dtype == torch.uint8
    assert [int(first[i, 0, 0, 0]) for i in range(4)] == [1, 2, 3, 0]  # the padded row is zeros
    buffers = staging.rings[("|u1", (3, 4, 4))].slots
    assert len(buffers) == 2
    assert all(first.data_ptr() != b.data_ptr() for b in buffers)
    # the next two batches go through the other buffer and then the first again: the tensor handed
    # out first is a copy, so overwriting its buffer leaves it as it was
    staging.upload([np.full((3, 4, 4), 7, dtype=np.uint8)], rows=1)
    staging.upload([np.full((3, 4, 4), 9, dtype=np.uint8)] * 4, rows=4)
    assert int(buffers[0][0, 0, 0, 0]) == 9 and int(first[0, 0, 0, 0]) == 1
    # another input shape gets its own buffers
    other = staging.upload([np.zeros((1, 2, 2), dtype=np.uint8)], rows=1)
    assert other.shape == (1, 1, 2, 2) and ("|u1", (1, 2, 2)) in staging.rings
    # preprocessed float32 rows (the Open Inference Protocol's INPUT__0) get a float32 ring of their own
    rows = staging.upload([np.full((3, 4, 4), 0.25, dtype=np.float32)], rows=2)
    assert rows.dtype == torch.float32 and rows[0, 0, 0, 0].item() == 0.25 and rows[1].abs().sum().item() == 0
    assert ("<f4", (3, 4, 4)) in staging.rings
    with pytest.raises(ValueError):
        staging.upload(arrays, rows=9)
    with pytest.raises(ValueError):
        staging.upload(arrays, rows=2)
