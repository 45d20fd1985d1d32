"""A data-parallel job's training on one rank: the inputs, plan and loop of a job on one device
(worker/kinds/train.py, worker/training/trainer.py) under a `GangPlacement` (worker/gang/collectives.py).

Every rank:
- rank 0 opens the rendezvous store on its worker's advertised address (that address only), starts
  the gang record with that address and a fresh secret (the store keys' namespace) and records the
  attempt's `ranks` in the job; the others got both before they started (worker/gang/member.py);
- loads the inputs and plans; rank 0 records the classes and its device choices in the job (the
  batch and schedule an earlier attempt ran kept), and the others take rank 0's batch, schedule
  and precision (autocast dtype, gradient scaler: they must step alike);
- marks itself ready, waits for every rank, joins the process group (gloo on CPUs, NCCL on GPUs,
  its timeout the gang's) and trains; rank 0 alone writes checkpoints and the job's state;
- leaves the process group, however training ended (aborted after a failure); rank 0 then closes
  the store, so its port is open only while the attempt forms and trains.
"""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path

from core.gangs.policy import collective_timeout_s
from core.jobs import NotOwner
from core.schemas import GangRank, Job
from worker.gang.collectives import (
    GangPlacement,
    RendezvousServer,
    bind_interfaces,
    init_group,
    is_collective_failure,
    join_store,
    leave_group,
)
from worker.gang.rank import FollowerReporter, GangBroken, LeaderReporter, Rank
from worker.kinds.train import record_outcome, training_inputs
from worker.runtime.job_context import JobOutcome, JobReporter, StopJob
from worker.training.trainer import Trainer, plan_training


def run_gang_training(job: Job, rank: Rank) -> JobOutcome | None:
    """Train `job` as `rank`; rank 0 returns the job's outcome, the others None. Rank 0's store is
    closed when this returns or raises, however the attempt ended."""
    try:
        return _train(job, rank)
    except (StopJob, NotOwner):
        raise
    except Exception as exc:
        if rank.leader and (isinstance(exc, GangBroken) or is_collective_failure(exc)):
            raise rank.fault(exc) from exc
        raise
    finally:
        if rank.rendezvous is not None:
            rank.rendezvous.close()
            rank.rendezvous = None


def _train(job: Job, rank: Rank) -> JobOutcome | None:
    runner, ctx = rank.runner, rank.ctx
    settings = runner.settings
    timeout_s = collective_timeout_s(settings)
    address = settings.resolved_advertise_address()
    bind_interfaces(address)
    if ctx is not None:
        rank.rendezvous = RendezvousServer(address, settings.rendezvous_port, timeout_s)
        rank.address, rank.secret = rank.rendezvous.address, secrets.token_hex(16)
        if not rank.records.start(job.id, rank.seat.attempt, rank.address, rank.secret):
            raise GangBroken("its reservation lapsed before rank 0 started it")
        ranks = [GangRank(rank=m.rank, device=m.device, worker=m.worker).model_dump() for m in rank.members]
        devices = ", ".join(m.device for m in rank.members)
        ctx.record({"ranks": ranks, "message": f"running on {rank.world_size} devices: {devices} (attempt {job.attempts})"},
                   ("gang", {"attempt": rank.seat.attempt, "ranks": ranks}))

    inputs = training_inputs(job, settings, runner.catalog, runner.store, runner.paths, runner.device.torch_device,
                             rank.should_stop)
    # Rank 0 keeps the batch and schedule an earlier attempt ran (an elastic resume on other devices);
    # the others take rank 0's below.
    plan = plan_training(job.id, job.model, inputs.params, inputs.data, inputs.device, inputs.channels,
                         inputs.height, inputs.width, earlier=job.device_choices if ctx is not None else None)
    if ctx is not None:
        ctx.set_classes(inputs.data.classes)
        ctx.record({"device_choices": plan.device.model_dump()})
        resume_from = ctx.resume_state()
        final_path = ctx.output_path("model.pt")
        reporter: JobReporter = LeaderReporter(ctx.reporter, rank)

        def resume_to(epoch: int) -> Path:
            return ctx.scratch_path(f"resume-{epoch}.pt")
    else:
        rank.wait_ready({0})
        recorded = runner.store.get(job.id).device_choices  # rank 0's choices: every rank steps alike
        if recorded is not None:
            plan = plan.with_choices(amp_dtype=recorded.amp_dtype, grad_scaler=recorded.grad_scaler,
                                     batch_size=recorded.batch_size, schedule=recorded.schedule)
        pointer = runner.store.raw_field(job.id, "resume")
        resume_from = runner.paths.resolve(job.id, pointer) if pointer else None
        final_path = Path(tempfile.gettempdir()) / f"torchyard-{job.id}-rank{rank.seat.rank}.pt"  # never written
        reporter = FollowerReporter(rank)

        def resume_to(epoch: int) -> Path:
            return final_path  # rank 0 writes the resume state; this path is never written

    rank.records.ready(job.id, rank.seat)
    rank.wait_ready(set(range(rank.world_size)))
    failed = True
    try:
        init_group(join_store(str(rank.address), timeout_s), str(rank.secret), rank.seat.rank, rank.world_size,
                   inputs.device, timeout_s)
        trainer = Trainer(plan, inputs.data, final_path=final_path, resume_from=resume_from, resume_to=resume_to,
                          reporter=reporter, should_stop=rank.should_stop, dataset=job.dataset, initial=inputs.initial,
                          resize_size=inputs.resize,
                          placement=GangPlacement(rank.seat.rank, rank.world_size, inputs.device))
        result = trainer.run()
        failed = False
    finally:
        leave_group(failed=failed)
    return record_outcome(job, ctx, result) if ctx is not None else None
