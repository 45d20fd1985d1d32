"""The serving graph (worker/checkpoints/forward_graph.py) with real torch: every architecture of the registry
is traced and answers exactly what its eager forward answers, at any batch size, with its
parameters shared; a network the trace would get wrong, or cannot follow, is served eagerly."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from models.registry import MODELS, build_model, get_model_spec
from worker.checkpoints.format import Preprocessing
from worker.checkpoints.forward_graph import ServingForward, build_forward
from worker.data.normalization import normalize, stats_tensors


def _preprocessing(name: str) -> Preprocessing:
    spec = get_model_spec(name).input
    return Preprocessing(spec.channels, spec.height, spec.width, (0.4, 0.5, 0.6)[:spec.channels],
                         (0.2, 0.25, 0.3)[:spec.channels])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_architecture_serves_a_traced_graph_with_the_eager_numbers(name: str) -> None:
    torch.manual_seed(0)
    pre = _preprocessing(name)
    network = build_model(name, 7, pre.channels).eval()
    graph = build_forward(network, pre, "cpu")
    assert graph.kind == "torchscript"
    assert isinstance(graph.run, torch.jit.ScriptModule)
    mean, std = stats_tensors(pre, "cpu")
    with torch.inference_mode(), torch.jit.optimized_execution(False):
        for batch in (1, 4):  # neither the trace's example size nor its probe's
            images = torch.randint(0, 256, (batch, pre.channels, pre.height, pre.width), dtype=torch.uint8)
            expected = torch.softmax(network(normalize(images, mean, std)).float(), dim=1)
            assert torch.equal(graph.run(images), expected)  # the same operators: the same numbers
    network_parameters = {p.data_ptr() for p in network.parameters()}
    assert {p.data_ptr() for p in graph.run.parameters()} == network_parameters  # no second copy


class _BranchesOnItsInput(nn.Module):
    """Data-dependent control flow: a trace records the branch its example took, for every input."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = x.mean(dim=(2, 3))
        if bool(pooled.sum() > 0):
            return self.head(pooled)
        return -self.head(pooled)


class _ReturnsADict(nn.Module):
    """An output the tracer does not accept."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": x.mean(dim=(2, 3))}


class _Noisy(nn.Module):
    """Traces without a warning, yet two runs never agree: the probe comparison catches it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = x.mean(dim=(2, 3))
        return pooled + torch.rand_like(pooled)


@pytest.mark.parametrize("network", [_BranchesOnItsInput(), _ReturnsADict(), _Noisy()],
                         ids=["branch on the input", "no trace", "probe differs"])
def test_a_network_the_trace_would_get_wrong_is_served_eagerly(network: nn.Module) -> None:
    pre = Preprocessing(3, 8, 8, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    graph = build_forward(network.eval(), pre, "cpu")
    assert graph.kind == "eager" and isinstance(graph.run, ServingForward)
    if isinstance(network, _BranchesOnItsInput):  # and eagerly it answers right, on both branches
        with torch.inference_mode():
            images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
            mean, std = stats_tensors(pre, "cpu")
            assert torch.equal(graph.run(images), torch.softmax(network(normalize(images, mean, std)), dim=1))


def test_tracing_leaves_the_global_random_state_alone() -> None:
    """A model loaded for /predict while a training job runs in the same process must not move the
    job's random stream (its shuffling and augmentation)."""
    pre = _preprocessing("cifar_net")
    network = build_model("cifar_net", 10).eval()
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_forward(network, pre, "cpu")
    assert torch.equal(torch.rand(4), expected)


class _Rendezvous(nn.Module):
    """Meets the other thread's trace mid-trace (first call only), then converts a tensor to a
    Python value (a TracerWarning): `kind` "bool" or "float" tells whose warning it is."""

    def __init__(self, kind: str, arrive: threading.Event, wait_for: threading.Event) -> None:
        super().__init__()
        self.kind, self.arrive, self.wait_for, self.met = kind, arrive, wait_for, False
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = x.mean(dim=(2, 3))
        if not self.met:
            self.met = True
            self.arrive.set()
            assert self.wait_for.wait(30), "the other thread never reached its trace"
        if self.kind == "bool":  # always true: the probe cannot tell, only the tracer's warning can
            return self.head(pooled) if bool(pooled.abs().sum() >= 0) else -self.head(pooled)
        return self.head(pooled) * float(pooled.max())


def test_a_trace_and_an_export_in_two_threads_each_see_their_own_warnings(tmp_path) -> None:
    """The warnings filters are the process's: the export's used to be set (and restored) while a
    serving trace ran on another thread, which then saw its TracerWarning only printed, and served
    a graph that branches on its example forever. Here the serving trace warns while the export is
    inside its trace: the serving graph must still be eager, and each thread caught only its own."""
    from worker.kinds.export import _write_torchscript

    serving_tracing, export_tracing, serving_warned = threading.Event(), threading.Event(), threading.Event()
    serving = _Rendezvous("bool", serving_tracing, export_tracing)
    exported = _Rendezvous("float", export_tracing, serving_warned)
    pre = Preprocessing(3, 8, 8, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    outcome: dict = {}

    def serve() -> None:
        outcome["graph"] = build_forward(serving.eval(), pre, "cpu")
        serving_warned.set()

    def export() -> None:
        assert serving_tracing.wait(30)  # the serving trace is under way (its setup done) before the export's
        outcome["export"] = _write_torchscript(exported.eval(), torch.rand(2, 3, 8, 8), tmp_path / "m.pt", {})

    threads = [threading.Thread(target=serve), threading.Thread(target=export)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert outcome["graph"].kind == "eager", "the serving trace missed its TracerWarning"
    assert outcome["export"] and all("Python float" in w for w in outcome["export"]), outcome["export"]
    assert not any("Python boolean" in w for w in outcome["export"])
