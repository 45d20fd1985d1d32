"""A dataset's name is one set: a taken name is refused unless the upload is its next version (the
name then means the newest, the older keeps its id), every route takes an id or a name, and the CLI
deletes by either, saying why when something must stay. Against the shared stack."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.datagen import shapes_zip
from tests.e2e.test_cli import cli
from tests.support import png_bytes, wait_until

pytestmark = pytest.mark.e2e


def _post(client, name: str, seed: int, **form: str):
    return client.post("/datasets", data={"name": name, **form},
                       files={"file": ("shapes.zip", shapes_zip(per_class=4, seed=seed, corrupt=None), "application/zip")})


def _folder(root: Path) -> Path:
    """A two-class ImageFolder directory of six small PNGs."""
    for label, channel in (("reds", 0), ("blues", 2)):
        (root / label).mkdir(parents=True)
        for k in range(3):
            pixels = np.full((8, 8, 3), 30, dtype=np.uint8)
            pixels[..., channel] = 200 + k
            (root / label / f"{k}.png").write_bytes(png_bytes(pixels))
    return root


def test_a_taken_name_is_refused_unless_it_is_a_new_version(stack: dict, tmp_path: Path) -> None:
    client = stack["client"]
    name = f"digits-{uuid.uuid4().hex[:6]}"
    first = _post(client, name, seed=1)
    assert first.status_code == 201, first.text
    v1 = first.json()
    assert v1["version"] == 1

    taken = _post(client, name, seed=2)
    assert taken.status_code == 409 and v1["id"] in taken.json()["detail"] and "new_version" in taken.json()["detail"]
    by_cli = cli(stack, "datasets", "upload", str(_folder(tmp_path / "set")), "--name", name)
    assert by_cli.returncode == 1 and v1["id"] in by_cli.stderr and "--new-version" in by_cli.stderr, by_cli.stderr
    assert _post(client, "fake", seed=2).status_code == 409  # a built-in's id is a name already
    listed = [d for d in client.get("/datasets").json()["datasets"] if d["name"] == name]
    assert [d["id"] for d in listed] == [v1["id"]]  # nothing recorded, nothing left on disk
    assert sorted(p.name for p in (stack["data_dir"] / "datasets").iterdir() if p.name.startswith(".upload-")) == []

    again = cli(stack, "datasets", "upload", str(tmp_path / "set"), "--name", name, "--new-version")
    assert again.returncode == 0, again.stderr
    assert f"({name}, version 2): 6 images, 2 classes" in again.stdout
    v2 = client.get(f"/datasets/{name}").json()  # the name means the newest; the older keeps its id
    assert v2["version"] == 2 and v2["id"] != v1["id"] and v2["classes"] == ["blues", "reds"]
    assert client.get(f"/datasets/{v1['id']}").json()["version"] == 1
    job = client.post("/jobs", json={"model": "cifar_net", "dataset": name, "epochs": 1}).json()
    assert job["dataset"] == v2["id"] and job["dataset_name"] == name

    # A job uses the newest: deleting it by name is refused with the API's reason, through the CLI too.
    held = cli(stack, "datasets", "delete", name)
    assert held.returncode == 1 and "(409)" in held.stderr and "job" in held.stderr, held.stderr
    client.post(f"/jobs/{job['id']}/cancel")
    wait_until(lambda: client.get(f"/jobs/{job['id']}").json()["status"] in ("cancelled", "succeeded", "failed"),
               timeout=120, what="the job to stop")
    deleted = wait_until(lambda: (r := cli(stack, "datasets", "delete", name)).returncode == 0 and r, timeout=30,
                         interval=1, what="the dataset's in-use grace to pass")
    assert f"dataset {name} deleted" in deleted.stdout
    assert client.get(f"/datasets/{name}").json()["id"] == v1["id"]  # the name falls back to the older version
    assert client.delete(f"/datasets/{name}").status_code == 204  # DELETE takes the name too
    gone = client.get(f"/datasets/{name}")
    assert gone.status_code == 404 and "unknown dataset" in gone.json()["detail"]

    builtin = cli(stack, "datasets", "delete", "fake")
    assert builtin.returncode == 1 and "built in" in builtin.stderr


def test_a_near_miss_is_answered_with_the_name_meant(stack: dict) -> None:
    client = stack["client"]
    name = f"flowers-{uuid.uuid4().hex[:4]}"
    assert _post(client, name, seed=3).status_code == 201
    missed = client.get(f"/datasets/{name[:-1]}")
    assert missed.status_code == 404 and f"did you mean {name!r}?" in missed.json()["detail"]
    submitted = cli(stack, "train", "--model", "cifar_net", "--dataset", name[:-1], "--detach")
    assert submitted.returncode == 1 and f"did you mean {name!r}?" in submitted.stderr
    assert "`torchyard datasets`" in submitted.stderr and "GET /datasets" not in submitted.stderr, submitted.stderr
    assert client.delete(f"/datasets/{name}").status_code == 204
