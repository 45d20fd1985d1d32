"""A prediction's computation as one TorchScript graph, which runs without the GIL.

A worker serves /predict from three kinds of threads in one process: the intake and the decode
pool decode images in Python (PIL holds the GIL for most of a small image's decode) while the
device thread runs the forward. An eager forward takes the GIL back after every operator (a few
dozen per forward), and each time a decoding thread holds it the device thread waits, up to the
interpreter's switch interval (`sys.getswitchinterval()`). Beside one decoding thread an eager
forward runs at a fraction of its speed alone, the shorter the forward the smaller the fraction,
while a traced one keeps most of it; the decoder pays GIL hand-offs beside the eager one too
(bench/forward_gil.py measures both; the figures: docs/benchmarks.md, "The forward beside
decoding threads" and "Figures that were quoted in code comments"). A traced graph is entered
once per batch and releases the GIL for the whole of it, so "decode in parallel, never on the
thread that feeds the device" holds on a CPU as on a GPU, where it also spares the feeding thread
the Python between kernel launches.

`ServingForward` is uint8 N×C×H×W on the device → class probabilities (float32): the scaling by
1/255, the checkpoint's normalisation (`ClassifierWithPreprocessing`, the module the export job
writes), the network and the softmax: the operators of the eager path, in the same order, so the
numbers are the same (checked at load against the eager module on a probe batch).

`torch.jit` is deprecated for new work in favour of torch.compile and torch.export, yet it is what
runs a graph without the GIL and without a compiler at run time (inductor needs one on a CPU),
on every torch from 2.6 on. The graph is traced (the networks have no data-dependent control
flow; the batch dimension stays dynamic) and shares its parameters with the eager module: no
second copy on the device. A trace that fails, that the tracer warns may not generalise (a Python
value read off a tensor, such as a branch on the input, became a constant: the warnings this
thread raised while tracing, caught by worker/checkpoints/thread_warnings.py, never by the process-global
filters, which another thread's trace or export could be changing at that moment), or whose
probabilities differ from the eager module's on a probe batch of another size by more than
GRAPH_TOLERANCE is not used: the eager module serves, and the worker logs why. Callers run the
graph inside `torch.jit.optimized_execution(False)`: the profiling executor would otherwise
re-specialise it at every new batch size (a slow first call at each new size, many forwards'
worth for resnet18) and its fusers may change the numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from worker.checkpoints import thread_warnings
from worker.checkpoints.format import Preprocessing

log = logging.getLogger(__name__)

GRAPH_TOLERANCE = 1e-5  # probabilities; on a CPU the trace gives the eager numbers exactly
PROBE_BATCH = 3  # not the example's size: a trace that baked in its batch size fails the probe
EXAMPLE_BATCH = 2


class ClassifierWithPreprocessing(nn.Module):
    """The network with its normalisation in front: float32 N×C×H×W in [0, 1] → logits."""

    def __init__(self, network: nn.Module, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.network = network
        shape = (1, len(mean), 1, 1)
        self.mean: torch.Tensor
        self.std: torch.Tensor
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(shape))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network((x - self.mean) / self.std)


class ServingForward(nn.Module):
    """uint8 N×C×H×W, as decoded → class probabilities (float32), as answered."""

    def __init__(self, network: nn.Module, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.classifier = ClassifierWithPreprocessing(network, mean, std)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.classifier(batch.float().div(255.0)).float(), dim=1)


class PreprocessedServingForward(nn.Module):
    """float32 N×C×H×W in [0, 1], preprocessed by the caller as an export's input (the Open
    Inference Protocol's INPUT__0) → class probabilities: `ServingForward` without the scaling."""

    def __init__(self, network: nn.Module, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.classifier = ClassifierWithPreprocessing(network, mean, std)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.classifier(batch).float(), dim=1)


@dataclass(frozen=True)
class ForwardGraph:
    run: Callable[[torch.Tensor], torch.Tensor]
    kind: str  # "torchscript", or "eager" when the trace could not be used


def build_forward(network: nn.Module, pre: Preprocessing, device: torch.device | str, *,
                  preprocessed: bool = False) -> ForwardGraph:
    """`network` (eval mode, on `device`) as its serving graph: traced when the trace is sound.
    `preprocessed`: the graph of float32 input in [0, 1] (`PreprocessedServingForward`), else of uint8."""
    module = PreprocessedServingForward if preprocessed else ServingForward
    eager = module(network, pre.mean, pre.std).to(device).eval()
    # A generator of its own: drawing from torch's global one would move the random state of a
    # training job running in this process.
    generator = torch.Generator().manual_seed(0)
    example, probe = (torch.randint(0, 256, (batch, pre.channels, pre.height, pre.width), dtype=torch.uint8,
                                    generator=generator).to(device) for batch in (EXAMPLE_BATCH, PROBE_BATCH))
    if preprocessed:
        example, probe = example.float().div(255.0), probe.float().div(255.0)
    try:
        with thread_warnings.caught() as found, torch.no_grad(), torch.jit.optimized_execution(False):
            traced = torch.jit.trace(eager, example, check_trace=False)
            difference = (traced(probe) - eager(probe)).abs().max().item()
    except Exception as exc:  # a network the tracer cannot follow is still served, eagerly
        log.warning("serving %s eagerly: tracing it failed (%s: %s)", type(network).__name__, type(exc).__name__, exc)
        return ForwardGraph(eager, "eager")
    warned = thread_warnings.tracer_warnings(found)
    if warned:  # a Python value read off a tensor became a constant: the graph may not generalise
        log.warning("serving %s eagerly: the tracer warned that its graph may not generalise (%s)",
                    type(network).__name__, warned[0])
        return ForwardGraph(eager, "eager")
    if not difference <= GRAPH_TOLERANCE:  # NaN included
        log.warning("serving %s eagerly: its traced graph differs from it by %g on a probe batch",
                    type(network).__name__, difference)
        return ForwardGraph(eager, "eager")
    return ForwardGraph(traced, "torchscript")
