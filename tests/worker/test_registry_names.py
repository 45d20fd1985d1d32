"""A project's alias is an MLflow registered model whose name MLflow takes (it refuses ':' and '/'),
and the default project's aliases keep the names they had before projects."""

from __future__ import annotations

from mlflow.utils.validation import _validate_model_name

from core.access.projects import scoped_name
from worker.tracking.registry import registered_name


def test_registered_names() -> None:
    assert registered_name(scoped_name("pets", "default")) == "pets"
    assert registered_name(scoped_name("pets", "alpha")) == "alpha+pets"
    for stored in (scoped_name("pets", "alpha"), scoped_name("team.pets_prod", "ml-ops")):
        _validate_model_name(registered_name(stored))  # raises for a name MLflow refuses
