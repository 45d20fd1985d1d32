"""The intake's budget (app/api/serving/budget.py): bytes reserved as they arrive, refused with a 503
and Retry-After past the process's budget or one client address's share, all given back at the end."""

from __future__ import annotations

import pytest

from app.api.serving.budget import RETRY_AFTER_S, BodyBudget
from core.errors import Unavailable


def test_bytes_are_held_as_they_arrive_and_given_back_once() -> None:
    budget = BodyBudget(limit_bytes=100, per_client_bytes=60)
    first, second = budget.reservation("10.0.0.1"), budget.reservation("10.0.0.2")
    first.reserve(40)
    second.reserve(50)
    assert (budget.held, budget.by_client) == (90, {"10.0.0.1": 40, "10.0.0.2": 50})
    first.release()
    first.release()  # idempotent: a request ends once, however many paths release it
    assert (budget.held, budget.by_client) == (50, {"10.0.0.2": 50})
    second.release()
    assert (budget.held, budget.by_client) == (0, {})


def test_past_the_budget_or_one_clients_share_a_request_is_refused_with_retry_after() -> None:
    budget = BodyBudget(limit_bytes=100, per_client_bytes=60)
    mine, again = budget.reservation("10.0.0.1"), budget.reservation("10.0.0.1")
    mine.reserve(50)
    with pytest.raises(Unavailable, match="TORCHYARD_PREDICT_MEMORY_PER_CLIENT_BYTES") as refused:
        again.reserve(11)  # 61 bytes from one address
    assert refused.value.retry_after_s == RETRY_AFTER_S
    other = budget.reservation("10.0.0.2")
    other.reserve(50)
    with pytest.raises(Unavailable, match="TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES"):
        budget.reservation("10.0.0.3").reserve(1)  # 101 bytes in the process
    # A refused chunk holds nothing: the budget is exactly what the accepted chunks hold.
    assert (budget.held, budget.by_client) == (100, {"10.0.0.1": 50, "10.0.0.2": 50})
    again.release()  # it holds nothing: giving it back changes nothing
    assert budget.by_client["10.0.0.1"] == 50


def test_no_share_per_client_leaves_one_address_the_whole_budget() -> None:
    budget = BodyBudget(limit_bytes=100, per_client_bytes=0)
    budget.reservation("10.0.0.1").reserve(100)
    with pytest.raises(Unavailable, match="TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES"):
        budget.reservation("10.0.0.1").reserve(1)
