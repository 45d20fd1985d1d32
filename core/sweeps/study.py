"""A sweep's Optuna study: its storage, and its sampler and pruner made again from the sweep's
request wherever the study is opened.

Storage: Optuna's journal on the service's own Redis (`JournalRedisBackend`), so the study lives
where every job lives, is shared by every API process and worker, survives their restarts and is
saved with Redis (AOF). One study per sweep, named by the sweep's id, in a journal of its own
(keys under `ty:optuna:<sweep id>`): opening it replays that sweep's log alone, and the sweep's
deletion deletes it.

Optuna stores neither the sampler nor the pruner with a study (a study loaded without `pruner=`
silently prunes with MedianPruner); `open_study` always makes both from the request. The sampler's
seed is the sweep's seed plus the trials asked so far: a sampler made again for each ask with the
same seed would draw the same first values every time (the grid sampler excepted: it gives trial n
the n-th point of a shuffle by its seed, which must be the same for every trial)."""

from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalRedisBackend

from core import keys
from core.sweeps.spec import Choices, FloatRange, IntRange, SweepSpec, grid_values

optuna.logging.set_verbosity(optuna.logging.WARNING)
log = logging.getLogger(__name__)

# Journal storages this process opened, one per sweep (newest used last), at most STORAGES_KEPT.
STORAGES_KEPT = 128
_storages: OrderedDict[tuple[str, str], JournalStorage] = OrderedDict()
_storages_lock = threading.Lock()


def journal_prefix(sweep_id: str) -> str:
    """Where a sweep's journal lives: its own keys, so opening it replays its trials alone (not every
    sweep's ever run), and deleting the sweep deletes them."""
    return f"{keys.OPTUNA_PREFIX}{sweep_id}"


def storage(redis_url: str, sweep_id: str) -> JournalStorage:
    """The sweep's journal storage, kept for the process: it keeps the log it replayed and reads only
    what was appended since."""
    with _storages_lock:
        found = _storages.get((redis_url, sweep_id))
        if found is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                found = JournalStorage(JournalRedisBackend(redis_url, prefix=journal_prefix(sweep_id)))
            _storages[(redis_url, sweep_id)] = found
            while len(_storages) > STORAGES_KEPT:
                _storages.popitem(last=False)
        else:
            _storages.move_to_end((redis_url, sweep_id))
        return found


def forget(redis_url: str, sweep_id: str) -> None:
    with _storages_lock:
        _storages.pop((redis_url, sweep_id), None)


def distributions(spec: SweepSpec) -> dict[str, BaseDistribution]:
    out: dict[str, BaseDistribution] = {}
    for name, rng in spec.space.items():
        if isinstance(rng, Choices):
            out[name] = CategoricalDistribution(rng.choices)
        elif isinstance(rng, IntRange):
            out[name] = IntDistribution(rng.low, rng.high, log=rng.log, step=rng.step)
        else:
            out[name] = FloatDistribution(rng.low, rng.high, log=rng.log, step=rng.step)
    return out


def make_sampler(spec: SweepSpec, asked: int) -> optuna.samplers.BaseSampler:
    seed = spec.seed + asked
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.sampler == "grid":  # trial n takes point n of a shuffle by the seed: the same seed every time
        grid: dict[str, Any] = {name: grid_values(rng) for name, rng in spec.space.items()}
        return optuna.samplers.GridSampler(grid, seed=spec.seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    max_epochs = _max_epochs(spec)
    if spec.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=spec.startup_trials, n_warmup_steps=spec.warmup_epochs)
    if spec.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1)
    if spec.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(max_epochs, 2))
    return optuna.pruners.NopPruner()


def _max_epochs(spec: SweepSpec) -> int:
    rng = spec.space.get("epochs")
    if isinstance(rng, IntRange):
        return rng.high
    if isinstance(rng, Choices):
        return max(int(c) for c in rng.choices)
    if isinstance(rng, FloatRange):
        return int(rng.high)
    return spec.base.epochs


def open_study(redis_url: str, sweep_id: str, spec: SweepSpec, asked: int = 0) -> optuna.Study:
    """The sweep's study (created on first use), with its sampler and pruner made from `spec`."""
    return optuna.create_study(study_name=sweep_id, storage=storage(redis_url, sweep_id),
                               direction=spec.resolved_direction,
                               sampler=make_sampler(spec, asked), pruner=make_pruner(spec), load_if_exists=True)


def should_prune(redis_url: str, sweep_id: str, spec: SweepSpec, number: int, epoch: int, value: float) -> bool:
    """Report a trial's epoch value to the study and ask the sweep's pruner whether it stops here."""
    study = open_study(redis_url, sweep_id, spec)
    store = storage(redis_url, sweep_id)
    trial_id = store.get_trial_id_from_study_id_trial_number(store.get_study_id_from_name(sweep_id), number)
    if store.get_trial(trial_id).state.is_finished():
        return False  # told already (the sweep was cancelled, or this is a stale delivery)
    trial = optuna.trial.Trial(study, trial_id)
    trial.report(value, epoch)
    return trial.should_prune()


def importances(study: optuna.Study) -> dict[str, float] | None:
    """Each parameter's importance (Optuna's default evaluator), or None when too few trials completed."""
    try:
        found = optuna.importance.get_param_importances(study)
    except (ValueError, RuntimeError) as exc:
        log.info("study %s: no parameter importances (%s)", study.study_name, exc)
        return None
    return {name: round(float(value), 6) for name, value in found.items()}
