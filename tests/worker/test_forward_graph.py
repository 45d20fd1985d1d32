"""The serving graph (worker/forward_graph.py) with real torch: every architecture of the registry
is traced and answers exactly what its eager forward answers, at any batch size, with its
parameters shared; a network the trace would get wrong, or cannot follow, is served eagerly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.registry import MODELS, build_model, get_model_spec
from worker.checkpoint import Preprocessing
from worker.forward_graph import ServingForward, build_forward
from worker.preprocess import normalize, stats_tensors


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
