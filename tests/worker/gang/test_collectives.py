"""A gang's ranks compute what one device computes: real processes joined by gloo through the
rendezvous store of worker/gang/collectives.py, each running the trainer's own step (worker/training/train_step.py)
on its shard of every global batch (batch norm over the global batch, the augmentation drawn for
the whole batch, losses weighted by unequal shares, a batch that leaves one rank empty), against
the same steps on one process with torch's own BatchNorm. Rank 0's store listens on its address
only, refuses what torch lets it refuse, and its port closes when it is closed."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.support import connects, free_port
from worker.gang.collectives import (
    GangPlacement,
    RendezvousServer,
    init_group,
    is_collective_failure,
    join_store,
    leave_group,
)
from worker.training.evaluation import measure
from worker.training.staging import ResidentBatches
from worker.training.train_step import OneDevice, StepRunner

WORLD_SIZE = 2
BATCHES = [[0, 5, 9, 13, 2, 7], [1, 3, 11, 4, 8], [12, 6, 10]]  # shares 3/2, then 2/1
LAST = [[12]]  # one image for two ranks: rank 1 takes part with none
VAL = torch.arange(14)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    images = torch.randint(0, 256, (14, 3, 12, 12), generator=gen, dtype=torch.uint8)
    return images, torch.arange(14) % 3


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3))


def _train(placement, model: nn.Module) -> tuple[list[float], object]:
    images, labels = _data()
    mean, std = torch.full((1, 3, 1, 1), 0.5), torch.full((1, 3, 1, 1), 0.25)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    runner = StepRunner(torch.device("cpu"), placement, augment=True, channels_last=False,
                        autocast=contextlib.nullcontext)
    backoff = placement.backoff(64, "training", lambda *_: None, lambda: None)
    train_model = placement.wrap(model)
    gen = torch.Generator().manual_seed(11)
    losses = []
    for batch in BATCHES + LAST:
        index = placement.shard(torch.tensor(batch))
        loss_sum, correct = runner.step(train_model, optimizer, scaler, nn.CrossEntropyLoss(), images[index],
                                        labels[index], gen, mean, std, backoff)
        loss_sum, correct = placement.reduce_sums(loss_sum, correct)
        losses.append(float(loss_sum))
    val = ResidentBatches(images[placement.shard(VAL)], labels[placement.shard(VAL)], torch.device("cpu"))
    measured = placement.reduce_measured(measure(model, val, 3, mean=mean, std=std, device=torch.device("cpu"),
                                                 batch_size=4), 3)
    return losses, measured


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    server = RendezvousServer("127.0.0.1", port, 20) if rank == 0 else None
    init_group(join_store(f"127.0.0.1:{port}", 20), "test", rank, WORLD_SIZE, torch.device("cpu"), 20)
    try:
        model = _model()
        losses, measured = _train(GangPlacement(rank, WORLD_SIZE, torch.device("cpu")), model)
        torch.save({"state": model.state_dict(), "losses": losses, "confusion": measured.confusion,
                    "accuracy": measured.accuracy, "num_images": measured.num_images, "loss": measured.loss},
                   Path(out) / f"{rank}.pt")
    finally:
        leave_group(failed=False)
        if server is not None:
            server.close()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_rank, args=(free_port(), str(out)), nprocs=WORLD_SIZE, join=True)
    return [torch.load(out / f"{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


def test_ranks_train_the_global_batch_as_one_device_does(ranks: list[dict]) -> None:
    model = _model()
    losses, measured = _train(OneDevice(), model)
    want = model.state_dict()
    for got in ranks:
        assert got["state"].keys() == want.keys()  # batch norm's parameters and buffers, as saved
        for name, tensor in want.items():
            assert torch.allclose(got["state"][name].double(), tensor.double(), atol=1e-5), name
        # The same on every rank, bit for bit: averaged gradients, identical steps.
        for name, tensor in ranks[0]["state"].items():
            assert torch.equal(got["state"][name], tensor), name
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        assert torch.equal(got["confusion"], measured.confusion)
        assert got["accuracy"] == measured.accuracy and got["num_images"] == len(VAL)
        assert got["loss"] == pytest.approx(measured.loss, abs=1e-5)
    assert ranks[0]["state"]["1.num_batches_tracked"] == len(BATCHES + LAST)


def test_what_a_peer_leaving_raises_is_recognised() -> None:
    assert is_collective_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                                              "closed by peer [127.0.0.1]:1234"))
    assert is_collective_failure(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms "
                                              "for recv operation to complete"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"))
    assert not is_collective_failure(ValueError("gloo"))


def test_the_store_listens_on_its_address_only_and_its_port_closes_with_it() -> None:
    """torch's TCPStore given a port alone listens on every interface; ours on the advertised address,
    so another address of this host (127.0.0.2, ::1) is refused; a client still open (as the process
    group holds one) does not keep the port open once the server is closed."""
    server = RendezvousServer("127.0.0.1", free_port(), 5)
    port = server.port
    assert server.address == f"127.0.0.1:{port}"
    client = join_store(server.address, 5)
    client.set("rank0", b"here")
    assert client.get("rank0") == b"here"
    assert connects("127.0.0.1", port)
    assert not connects("127.0.0.2", port) and not connects("::1", port)
    if server.bounds_messages:  # libuv: what no rank sends (a value over 8 MiB) closes the connection
        with pytest.raises(torch.distributed.DistError, match=r"(?i)reset|closed|broken"):
            join_store(server.address, 5).set("big", b"x" * (9 << 20))
    server.close()
    assert not connects("127.0.0.1", port)
    del client


def test_the_store_takes_the_next_port_when_its_first_is_taken() -> None:
    first = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        taken.listen()
        with RendezvousServer("127.0.0.1", first, 5) as server:
            assert server.port != first and connects("127.0.0.1", server.port)
        assert not connects("127.0.0.1", server.port)
