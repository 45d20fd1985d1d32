"""What a newcomer reads when they get something wrong, or right: refusals in their own
words, before anything runs, and the CLI naming what they named. Against the shared stack."""

from __future__ import annotations

import pytest
import torch

from tests.datagen import zip_of
from tests.e2e.test_cli import cli
from tests.support import REPO, png_bytes
from worker.data.datasets import fake_images

pytestmark = pytest.mark.e2e


def _pattern_pngs(label: int, count: int) -> list[bytes]:
    images = fake_images(torch.tensor([label] * count), 3, 32, 32, seed=99)
    return [png_bytes(image.permute(1, 2, 0).numpy()) for image in images]


def _upload(client, name: str, classes: dict[str, int]) -> dict:
    entries = {f"{folder}/{k}.png": data for folder, label in classes.items()
               for k, data in enumerate(_pattern_pngs(label, 6))}
    uploaded = client.post("/datasets", data={"name": name},
                           files={"file": (f"{name}.zip", zip_of(entries), "application/zip")})
    assert uploaded.status_code == 201, uploaded.text
    return uploaded.json()


def test_validation_errors_name_the_fields_the_user_sent(stack: dict) -> None:
    client = stack["client"]
    cases = [
        ({"model": "cifar_net", "dataset": "fake", "epochs": 0}, "epochs: Input should be greater than or equal to 1"),
        ({"model": "cifar_net", "dataset": "fake", "foo": 1}, "unknown field 'foo'"),
        ({"kind": "evaluate", "model": "cifar_net"}, "kind 'evaluate' is not a kind of job POST /jobs creates"),
        ({"dataset": "fake"}, "model is required"),
        ({"kind": "predict", "dataset": "fake"}, "give exactly one of job_id and alias"),
        ({"kind": "predict", "dataset": "fake", "job_id": "j", "top_k": 0}, "top_k: Input should be"),
        ([1, 2], "the body must be a JSON object"),
    ]
    for body, said in cases:
        answer = client.post("/jobs", json=body)
        assert answer.status_code == 422, (body, answer.text)
        detail = answer.json()["detail"]
        assert said in detail, (body, detail)
        for internal in ("train.", "predict.", "_spec_kind", "Input tag", "Value error", "Field required"):
            assert internal not in detail, (body, detail)
        assert all(error["loc"][1:2] not in (["train"], ["predict"]) for error in answer.json()["errors"])
    not_json = client.post("/jobs", content=b"{oops", headers={"Content-Type": "application/json"})
    assert not_json.status_code == 422 and not_json.json()["detail"].startswith("the body is not valid JSON")


def test_training_and_evaluating_need_two_classes(stack: dict, cifar_pair: tuple[str, str]) -> None:
    """A one-class upload stays (it can be predicted on); training or evaluating on it is a 422
    that says why, where it used to 'succeed' with accuracy 1.0 and loss 0."""
    client = stack["client"]
    single = _upload(client, "only-threes", {"pattern_3": 3})
    assert single["classes"] == ["pattern_3"]
    trained = client.post("/jobs", json={"model": "cifar_net", "dataset": "only-threes", "epochs": 1})
    assert trained.status_code == 422, trained.text
    assert "has one class ('pattern_3'): training needs at least two classes" in trained.json()["detail"]
    evaluated = client.post(f"/jobs/{cifar_pair[0]}/evaluate", json={"dataset": single["id"]})
    assert evaluated.status_code == 422, evaluated.text
    assert "an evaluation needs at least two classes" in evaluated.json()["detail"]
    predicted = client.post("/jobs", json={"kind": "predict", "job_id": cifar_pair[0], "dataset": single["id"]})
    assert predicted.status_code == 202, predicted.text
    assert client.get(f"/datasets/{single['id']}").status_code == 200


def test_the_cli_names_the_dataset_and_the_alias(stack: dict, cifar_pair: tuple[str, str]) -> None:
    job_id = cifar_pair[0]
    dataset = _upload(stack["client"], "threes-and-sevens", {"pattern_3": 3, "pattern_7": 7})
    evaluated = cli(stack, "evaluate", job_id, "--dataset", "threes-and-sevens")
    assert evaluated.returncode == 0, evaluated.stderr
    assert "threes-and-sevens (all images): accuracy" in evaluated.stdout
    assert f"{dataset['id']} (all images)" not in evaluated.stdout
    assert "queued: job" in evaluated.stderr and "on threes-and-sevens" in evaluated.stderr

    assert stack["client"].put("/aliases/words-pets", json={"job_id": job_id}).status_code in (200, 201)
    try:
        answer = cli(stack, "predict", "--alias", "words-pets", str(REPO / "examples" / "pattern_3.png"))
        assert answer.returncode == 0, answer.stderr
        assert f"alias words-pets → job {job_id}" in answer.stdout.splitlines()[0]
    finally:
        stack["client"].delete("/aliases/words-pets")
