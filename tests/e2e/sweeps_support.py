"""What the sweep tests share (tests/e2e/test_sweeps.py, test_dashboard_sweeps.py): small bodies,
the wait for a sweep's end, and the grid sweep the session runs once (the `grid_sweep` fixture in
tests/e2e/conftest.py), which the API, CLI and dashboard tests all read."""

from __future__ import annotations

import httpx

from tests.support import wait_until

BASE = {"model": "cifar_net", "dataset": "fake", "epochs": 2, "patience": 0}
SWEEP_END = {"succeeded", "failed", "cancelled"}
# Two trials of a 2×2 grid, one at a time, the median pruner judging from the first complete trial
# on: seed 6 puts lr 0.03 first and lr 1e-7 (which learns nothing) second, so the second is pruned.
GRID_KEY = "grid-sweep"


def sweep_body(**changes: object) -> dict:
    body = {"base": BASE, "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}},
            "trials": 2, "parallel": 1, "sampler": "random", "pruner": "none"}
    return {**body, **changes}


GRID_BODY = sweep_body(space={"learning_rate": {"type": "categorical", "choices": [0.03, 1e-7]},
                              "weight_decay": {"type": "categorical", "choices": [0.0, 0.01]}},
                       trials=2, sampler="grid", pruner="median", startup_trials=1, seed=6)


def wait_for_sweep(client: httpx.Client, sweep_id: str, timeout: float = 240) -> dict:
    def ended() -> dict | None:
        sweep = client.get(f"/sweeps/{sweep_id}").json()
        done = sweep["status"] in SWEEP_END and all(t["state"] != "running" for t in sweep["trials"])
        return sweep if done else None

    return wait_until(ended, timeout=timeout, interval=0.5, what=f"sweep {sweep_id} to end")


def run_grid_sweep(client: httpx.Client) -> dict:
    created = client.post("/sweeps", json=GRID_BODY, headers={"Idempotency-Key": GRID_KEY})
    assert created.status_code == 201, created.text
    return wait_for_sweep(client, created.json()["id"])
