import pytest
import torch

from models.registry import build_model
from worker.checkpoints.format import CheckpointError, ModelMeta, Preprocessing, load_model, load_payload, save_model


def _meta() -> ModelMeta:
    return ModelMeta("cifar_net", 3, ["a", "b", "c"], Preprocessing(3, 32, 32, (0.5, 0.4, 0.3), (0.2, 0.2, 0.2)), "job1")


def test_round_trip_with_weights_only(tmp_path) -> None:
    model = build_model("cifar_net", 3)
    path = tmp_path / "job1" / "model.pt"
    save_model(path, model, _meta())
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]  # no temp file left behind
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert raw["meta"]["classes"] == ["a", "b", "c"]
    loaded, meta = load_model(path, "cpu")
    assert meta == _meta()
    assert not loaded.training
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(loaded(x), model.eval()(x))


def test_truncated_checkpoint_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "job1" / "model.pt"
    save_model(path, build_model("cifar_net", 3), _meta())
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_model(path)


def test_foreign_pickle_is_refused(tmp_path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"format": "torchyard.checkpoint/1", "x": Evil()}, path)
    with pytest.raises(CheckpointError, match="weights_only"):
        load_payload(path)


def test_missing_checkpoint(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_payload(tmp_path / "nope.pt")
