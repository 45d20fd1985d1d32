"""Fixtures of the end-to-end tests that several modules share (on the session's `stack`)."""

from __future__ import annotations

import pytest

from tests.support import wait_for_job


@pytest.fixture(scope="session")
def cifar_pair(stack: dict) -> tuple[str, str]:
    """Two succeeded cifar_net jobs on `fake` (1 epoch, seeds 11 and 12): two models told apart."""
    client = stack["client"]
    jobs = [client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1, "seed": s}).json()
            for s in (11, 12)]
    done = [wait_for_job(client, j["id"], {"succeeded", "failed"}, timeout=240) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded", "succeeded"], [d.get("error") for d in done]
    return done[0]["id"], done[1]["id"]


@pytest.fixture(scope="session")
def grid_sweep(stack: dict) -> dict:
    """The small grid sweep (tests/e2e/sweeps_support.GRID_BODY) run to its end once, as it ended."""
    from tests.e2e.sweeps_support import run_grid_sweep

    return run_grid_sweep(stack["client"])
