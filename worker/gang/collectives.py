"""torch.distributed for one rank of a gang: the rendezvous store, the process group, and what the
training loop needs of them (`GangPlacement`, the trainer's `Placement` for a rank).

What each rank computes, so a job's result does not depend on how many devices ran it:

- **The data.** Every rank holds the whole resident split and draws the same permutation per
  epoch (from the job's seed); each global batch (`batch_size` images) is split by stride, rank
  r taking positions r, r+N, r+2N, ... of it (DistributedSampler's sharding, without its padding:
  no image is counted twice; a short last batch leaves ranks one image apart).
- **The gradient.** DistributedDataParallel averages the ranks' gradients; each rank's loss is
  weighted by its share of the global batch (images × N / batch), so the average is the gradient
  of the global batch's mean loss, as on one device, also when the shares are unequal.
- **Batch norm** normalises with the global batch's statistics (`GlobalBatchNorm`: sums and
  squared deviations all-reduced, through a differentiable all-reduce), so BatchNorm networks
  see what one device sees; the running statistics, updated from them, stay equal on every rank.
- **Augmentation**: the crop and flip draws are made for the whole global batch from the epoch's
  generator, the same on every rank, and each rank applies its own rows.
- **Metrics**: training loss and accuracy, and validation's confusion matrix and loss, are summed
  across ranks (validation is sharded the same way), so every rank reports the global figures.
- **Out of memory** on one rank ends the attempt (no micro-batch back-off: the ranks' collectives
  must match): the job fails, asking for a smaller global batch.

The CUDA branch is the CPU one, call for call, with NCCL instead of gloo (docs/gpu.md).
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from core.gangs.policy import RENDEZVOUS_PORTS
from worker.runtime.job_context import JobFailed
from worker.training.augment import apply_crop_flip, crop_flip_draws
from worker.training.backoff import BatchBackoff
from worker.training.evaluation import Measured

log = logging.getLogger(__name__)

# What a collective that failed because a peer left raises, besides torch.distributed.DistError:
# gloo's and NCCL's RuntimeErrors name their transport.
_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "c10d", "processgroup")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def is_collective_failure(exc: BaseException) -> bool:
    """A collective or the store failed: a peer died, froze past the timeout or left."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _COLLECTIVE_MARKERS)


def bind_interfaces(address: str) -> None:
    """gloo and NCCL listen on the interface of the host name's address unless told otherwise; point
    them at the interface that holds the advertised address (unless the operator set one)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return


class RendezvousServer:
    """Rank 0's rendezvous store, for one attempt: torch's TCPStore server, listening on the advertised
    address only (never on every interface, which is what TCPStore does with a port alone: it binds
    `::` or 0.0.0.0 whatever host name it is given), from the first free port of `first_port` +
    [0, RENDEZVOUS_PORTS). Every rank, rank 0 included, talks to it through a client store
    (`join_store`), so this object holds the server's only reference: `close()` (or leaving the `with`
    block) ends it and closes its port at once, whatever still holds a client.

    What torch lets it refuse (docs/security.md): with the libuv server (torch's default) a key over
    8 KiB or a value over 8 MiB closes the sender's connection; the legacy server, used where libuv
    cannot take a listening socket (torch releases before that support came, in 2025), accepts any
    size. Nothing bounds the total or authenticates a client: the port must be reachable by the
    other workers only.
    """

    def __init__(self, address: str, first_port: int, timeout_s: float) -> None:
        family, _, _, _, where = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0]
        host = str(where[0])
        last: OSError | None = None
        for port in range(first_port, min(first_port + RENDEZVOUS_PORTS, 65536)):
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own listen does
                listener.bind((host, port))
                listener.listen(socket.SOMAXCONN)
            except OSError as exc:  # the port is taken (another gang's rank 0 on this host)
                listener.close()
                last = exc
                continue
            self._server: dist.TCPStore | None = _serve(host, port, listener.detach(), timeout_s)
            self.host, self.port = host, port
            return
        raise RuntimeError(f"no free rendezvous port on {host} in {first_port}..{first_port + RENDEZVOUS_PORTS - 1}: "
                           f"{last}")

    @property
    def bounds_messages(self) -> bool:
        """Whether the server refuses an oversized key or value (the libuv server does)."""
        return self._server is not None and bool(self._server.libuvBackend)

    @property
    def address(self) -> str:
        """"<host>:<port>", as the gang record publishes it and `join_store` reads it."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop the server: its thread ends and its port closes (clients still open see it gone)."""
        self._server = None

    def __enter__(self) -> RendezvousServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(host: str, port: int, fd: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on the listening socket `fd` (TCPStore owns it from here). libuv first: it
    bounds each message; a torch whose libuv server takes no listening socket says so before it
    touches the descriptor (NotImplementedError), and the legacy server takes it instead."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd,
                             use_libuv=True)
    except NotImplementedError:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd,
                             use_libuv=False)


def join_store(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of rank 0's store at "<host>:<port>" (an IPv6 host in brackets)."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def init_group(store: dist.Store, namespace: str, rank: int, world_size: int, device: torch.device,
               timeout_s: float) -> None:
    """This process's default process group for the attempt: NCCL on the pinned GPU (cuda:0 in a
    pinned worker), gloo on the CPU; every collective gives up after `timeout_s`. Its keys live under
    `namespace` in the store: the attempt's secret (core/gangs/records.py), which a stranger reaching the
    store's port cannot guess, so it cannot read or overwrite the addresses the ranks exchange."""
    leave_group(failed=True)  # an earlier attempt's group, if its teardown was cut short
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        # A failed or timed-out collective aborts the communicator and raises in the training thread,
        # instead of the default of tearing the whole worker down (its /predict thread with it).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # the communicator is formed now, inside the rendezvous
    dist.init_process_group(backend_for(device), store=dist.PrefixStore(f"torchyard/{namespace}", store), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def leave_group(*, failed: bool) -> None:
    """End this process's process group: NCCL's is aborted after a failure (a collective destroy
    would wait for peers that are gone); otherwise destroyed."""
    if not dist.is_initialized():
        return
    try:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if failed and abort is not None and dist.get_backend() == "nccl":
            abort()
        else:
            dist.destroy_process_group()
    except Exception:
        log.warning("leaving the process group failed; it is dropped", exc_info=True)
        if dist.is_initialized():
            dist.destroy_process_group()


class _AllReduceSum(torch.autograd.Function):
    """A sum across ranks whose gradient is the sum of the ranks' gradients (each rank's output
    feeds its own loss; the job's loss is their sum)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        dist.all_reduce(out)
        return out


class _GlobalStats:
    """BatchNorm over the global batch while training in a process group (see the module docstring);
    as torch's BatchNorm otherwise. Same parameters and buffers: checkpoints are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn: Any = self
        if not (bn.training and bn.track_running_stats and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)  # type: ignore[misc]
        bn._check_input_dim(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        xs = x.float()
        count = torch.full((1,), x.numel() / max(1, x.size(1)), device=x.device, dtype=torch.float32)
        totals = _AllReduceSum.apply(torch.cat([xs.sum(dims), count]))
        n = totals[-1]
        mean = totals[:-1] / n
        centered = xs - mean.view(shape)
        var = _AllReduceSum.apply((centered * centered).sum(dims)) / n
        y = centered * torch.rsqrt(var + bn.eps).view(shape)
        if bn.affine:
            y = y * bn.weight.view(shape) + bn.bias.view(shape)
        with torch.no_grad():
            bn.num_batches_tracked += 1
            factor = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            bn.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
            bn.running_var.mul_(1 - factor).add_(var.detach() * n / torch.clamp(n - 1, min=1), alpha=factor)
        return y.to(x.dtype)


class GlobalBatchNorm1d(_GlobalStats, nn.BatchNorm1d):
    pass


class GlobalBatchNorm2d(_GlobalStats, nn.BatchNorm2d):
    pass


class GlobalBatchNorm3d(_GlobalStats, nn.BatchNorm3d):
    pass


_DDP_PARAMETERS = inspect.signature(DistributedDataParallel.__init__).parameters
_GLOBAL: dict[type[nn.Module], type[nn.Module]] = {nn.BatchNorm1d: GlobalBatchNorm1d, nn.BatchNorm2d: GlobalBatchNorm2d, nn.BatchNorm3d: GlobalBatchNorm3d}


def global_batch_norm(model: nn.Module) -> nn.Module:
    """Every BatchNorm of `model` normalises over the global batch (in place: same parameters)."""
    for module in model.modules():
        if type(module) in _GLOBAL:
            module.__class__ = _GLOBAL[type(module)]
    return model


class GangBackoff(BatchBackoff):
    """No smaller micro-batches in a gang (every rank must run the same collectives): out of memory
    ends the job with advice."""

    def __init__(self, size: int, what: str, *, rank: int, world_size: int, **kwargs: Any) -> None:
        super().__init__(size, what, floor=size, retries_at_floor=0, **kwargs)
        self.rank, self.world_size = rank, world_size

    def out_of_memory(self, error: str) -> None:
        self._release()
        raise JobFailed(f"out of memory in {self.what} on rank {self.rank} (about {self.size // self.world_size} "
                        f"images per rank): lower batch_size (the global batch) or image_size ({error[:500]})")


class GangPlacement:
    """Rank `rank` of `world_size` in the current process group (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.leader = rank == 0
        self._global = 0  # the images of the step being sharded

    def wrap(self, model: nn.Module) -> nn.Module:
        global_batch_norm(model)
        ids = [self.device.index or 0] if self.device.type == "cuda" else None
        # Buffers (batch norm's running statistics) are computed alike on every rank: nothing to send
        # before each forward (torch 2.14 renamed the flag; older versions know only the first name).
        flag = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMETERS else "broadcast_buffers"
        options: dict[str, Any] = {flag: False}
        return DistributedDataParallel(model, device_ids=ids, **options)

    def shard(self, index: torch.Tensor) -> torch.Tensor:
        self._global = len(index)
        return index[self.rank::self.world_size]

    def weight(self, images: int, local: int) -> float:
        return images * self.world_size / self._global

    def augment(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        shifts, flips = crop_flip_draws(self._global, images.shape[2], images.shape[3], generator, images.device)
        mine = slice(self.rank, None, self.world_size)
        return apply_crop_flip(images, shifts[mine], flips[mine])

    def reduce_sums(self, loss_sum: torch.Tensor, correct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.stack([loss_sum.double(), correct.double()])
        dist.all_reduce(both)
        return both[0], both[1].round().long()

    def reduce_measured(self, measured: Measured | None, num_classes: int) -> Measured | None:
        confusion = measured.confusion if measured is not None else torch.zeros(num_classes, num_classes,
                                                                                  dtype=torch.int64)
        loss_total = measured.loss * measured.num_images if measured is not None else 0.0
        packed = torch.cat([confusion.flatten().double(), torch.tensor([loss_total], dtype=torch.float64)])
        packed = packed.to(self.device)
        dist.all_reduce(packed)
        packed = packed.cpu()
        matrix = packed[:-1].round().long().view(num_classes, num_classes)
        total = int(matrix.sum())
        if total == 0:
            return None
        return Measured(num_images=total, loss=round(float(packed[-1]) / total, 6),
                        accuracy=round(int(matrix.diagonal().sum()) / total, 6), confusion=matrix)

    def backoff(self, size: int, what: str, notify: Callable[[str, dict[str, Any]], None],
                release: Callable[[], None]) -> BatchBackoff:
        return GangBackoff(size, what, rank=self.rank, world_size=self.world_size, notify=notify, release=release)
