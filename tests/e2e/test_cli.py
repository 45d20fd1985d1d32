"""The `torchyard` client commands, run as the real console script against the session's stack."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support import REPO, png_bytes, wait_for_job, wait_until

pytestmark = pytest.mark.e2e

_SCRIPT = Path(sys.executable).parent / "torchyard"
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "app.cli"]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI under test: this checkout's code first on the path (the console
    script of a shared virtualenv imports the checkout it was installed from), no API key."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.pop("TORCHYARD_API_KEY", None)
    return env


def _env(stack: dict, **extra: str) -> dict[str, str]:
    return cli_env(TORCHYARD_URL=f"http://127.0.0.1:{stack['port']}", **extra)


def cli(stack: dict, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, env=_env(stack), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def trained(stack: dict) -> dict:
    """One job trained through `torchyard train --json` (followed over SSE to the end)."""
    result = cli(stack, "train", "--model", "cifar_net", "--dataset", "fake", "--epochs", "1", "--seed", "3",
                 "--json")
    assert result.returncode == 0, result.stderr
    job = json.loads(result.stdout)
    assert job["status"] == "succeeded", job["error"]
    assert "queued" in result.stderr  # the submission line; --json keeps stdout for the JSON alone
    return job


def test_train_json_reports_the_finished_job(trained: dict) -> None:
    assert trained["params"]["epochs"] == 1 and trained["params"]["seed"] == 3
    assert [m["epoch"] for m in trained["metrics"]] == [1]
    per_class = trained["metrics"][-1]["per_class_accuracy"]
    assert set(per_class) == {f"pattern_{k}" for k in range(10)}
    assert trained["checkpoint"]["sha256"]


def test_job_and_jobs(stack: dict, trained: dict) -> None:
    shown = cli(stack, "job", trained["id"])
    assert shown.returncode == 0, shown.stderr
    assert "succeeded" in shown.stdout and "cifar_net" in shown.stdout
    assert "train_loss" in shown.stdout and "val_acc" in shown.stdout  # the metrics table
    assert "Accuracy of pattern_3" in shown.stdout  # per class, as in the PyTorch tutorial
    chose = trained["device_choices"]  # the worker's choices, a row apart from the params given
    assert chose["device"] == "cpu" and f"batch_size={chose['batch_size']}" in shown.stdout
    assert f"precision={chose['amp_dtype'] or 'fp32'}" in shown.stdout

    listed = cli(stack, "jobs")
    assert listed.returncode == 0, listed.stderr
    assert trained["id"] in listed.stdout
    as_json = json.loads(cli(stack, "jobs", "--status", "succeeded", "--json").stdout)
    assert trained["id"] in [j["id"] for j in as_json["jobs"]]
    assert {j["status"] for j in as_json["jobs"]} == {"succeeded"}

    followed = cli(stack, "job", trained["id"], "--follow", "--json")  # a finished job: replay, then the record
    assert followed.returncode == 0, followed.stderr
    assert json.loads(followed.stdout)["id"] == trained["id"]


def test_predict(stack: dict, trained: dict) -> None:
    result = cli(stack, "predict", "--job", trained["id"], "--top-k", "3", "--json",
                 str(REPO / "examples" / "pattern_3.png"), str(REPO / "examples" / "pattern_7.png"))
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert [r["filename"] for r in answer["results"]] == ["pattern_3.png", "pattern_7.png"]
    assert [r["predictions"][0]["label"] for r in answer["results"]] == ["pattern_3", "pattern_7"]
    assert len(answer["results"][0]["predictions"]) == 3

    # Into a reader that has left (`| head -1` at its end): one exit status, no traceback.
    piped = subprocess.Popen([*CLI, "--json", "predict", "--job", trained["id"], "examples/pattern_3.png"], cwd=REPO,
                             env=_env(stack), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    piped.stdout.close()  # type: ignore[union-attr]
    said = piped.stderr.read()  # type: ignore[union-attr]
    assert piped.wait(240) == 1 and "Traceback" not in said and "BrokenPipe" not in said, said

    text = cli(stack, "predict", "--job", trained["id"], str(REPO / "examples" / "pattern_3.png"))
    assert text.returncode == 0, text.stderr
    first_row = text.stdout.splitlines()[1]
    assert first_row.split()[0] == "pattern_3" and first_row.rstrip().endswith("%")


def test_checkpoint_download(stack: dict, trained: dict, tmp_path: Path) -> None:
    target = tmp_path / "out" / "model.pt"
    result = cli(stack, "checkpoint", trained["id"], "-o", str(target))
    assert result.returncode == 0, result.stderr
    assert trained["checkpoint"]["sha256"] in result.stdout
    assert target.stat().st_size == trained["checkpoint"]["bytes"]
    payload = torch.load(target, map_location="cpu", weights_only=True)
    assert payload["meta"]["architecture"] == "cifar_net"
    assert not list(target.parent.glob("*.part"))


def test_devices(stack: dict) -> None:
    text = cli(stack, "devices")
    assert text.returncode == 0, text.stderr
    assert "/cpu" in text.stdout and "memory" in text.stdout
    devices = json.loads(cli(stack, "devices", "--json").stdout)
    assert any(d["type"] == "cpu" and d["status"] != "offline" for d in devices)


def test_errors_are_one_line_with_the_api_detail(stack: dict) -> None:
    detail = stack["client"].get("/jobs/no-such-job").json()["detail"]
    result = cli(stack, "job", "no-such-job")
    assert result.returncode != 0
    assert detail in result.stderr and "404" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr

    bad = cli(stack, "train", "--model", "no_such_model", "--dataset", "fake")
    assert bad.returncode != 0 and "no_such_model" in bad.stderr

    result = subprocess.run([*CLI, "devices", "--url", "http://127.0.0.1:9"], cwd=REPO, env=_env(stack),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "cannot reach" in result.stderr and "Traceback" not in result.stderr


def test_datasets_upload_of_a_directory(stack: dict, tmp_path: Path) -> None:
    root = tmp_path / "shapes"
    rng = np.random.default_rng(0)
    for name, channel in (("reds", 0), ("blues", 2)):
        (root / name).mkdir(parents=True)
        for k in range(4):
            image = rng.integers(0, 40, (12, 12, 3), dtype=np.uint8)
            image[..., channel] = 220
            (root / name / f"{k}.png").write_bytes(png_bytes(image))
    (root / "reds" / "broken.png").write_bytes(b"not a png")

    result = cli(stack, "datasets", "upload", str(root), "--name", "cli-shapes", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["name"] == "cli-shapes" and sorted(record["classes"]) == ["blues", "reds"]
    assert record["num_images"] == 8 and record["class_counts"] == {"blues": 4, "reds": 4}
    assert [s["path"] for s in record["skipped"]] == ["reds/broken.png"]

    listed = cli(stack, "datasets")
    assert listed.returncode == 0 and record["id"] in listed.stdout and "fake" in listed.stdout


def _sigint_default() -> None:
    """Ctrl-C as in a terminal: a runner that started us in the background (a non-interactive
    shell's `&`) leaves SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_following(stack: dict, *extra: str, stdin: int = subprocess.DEVNULL
                      ) -> tuple[subprocess.Popen, str, list[str]]:
    """`torchyard train` of a long job; returns once the job is being followed."""
    proc = subprocess.Popen([*CLI, "train", "--model", "cifar_net", "--dataset", "fake", "--epochs", "200",
                             "--patience", "0", *extra],
                            cwd=REPO, env=_env(stack), stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    # The first status event ("queued") is printed once the event stream is being read.
    wait_until(lambda: any(line.strip() == "queued" for line in lines), timeout=60, what="the follow to start")
    job_id = lines[0].split()[1]
    proc.reader = reader  # type: ignore[attr-defined]
    return proc, job_id, lines


def test_interrupt_without_a_tty_leaves_the_job_running(stack: dict) -> None:
    client = stack["client"]
    proc, job_id, lines = _start_following(stack)
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        proc.reader.join(10)  # type: ignore[attr-defined]
        assert any(job_id in line and "keeps running" in line for line in lines), lines
        assert client.get(f"/jobs/{job_id}").json()["status"] in ("queued", "running")

        cancelled = cli(stack, "cancel", job_id)
        assert cancelled.returncode == 0, cancelled.stderr
        assert wait_for_job(client, job_id, {"cancelled", "succeeded", "failed"})["status"] == "cancelled"
        again = cli(stack, "cancel", job_id)
        assert again.returncode != 0 and "409" in again.stderr
    finally:
        proc.kill()
        client.post(f"/jobs/{job_id}/cancel")


def test_interrupt_with_cancel_on_interrupt_cancels(stack: dict) -> None:
    client = stack["client"]
    proc, job_id, _lines = _start_following(stack, "--cancel-on-interrupt")
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        assert wait_for_job(client, job_id, {"cancelled", "succeeded", "failed"})["status"] == "cancelled"
    finally:
        proc.kill()
        client.post(f"/jobs/{job_id}/cancel")


def test_interrupt_on_a_terminal_asks_before_cancelling(stack: dict) -> None:
    client = stack["client"]
    controller, terminal = pty.openpty()
    proc, job_id, _ = _start_following(stack, stdin=terminal)
    try:
        proc.send_signal(signal.SIGINT)
        prompt = wait_until(lambda: proc.stdout.read(len("Cancel job")), timeout=30,  # type: ignore[union-attr]
                            what="the cancel prompt")
        assert prompt == "Cancel job"
        os.write(controller, b"y\n")
        assert proc.wait(30) == 130
        assert wait_for_job(client, job_id, {"cancelled", "succeeded", "failed"})["status"] == "cancelled"
    finally:
        proc.kill()
        os.close(controller)
        os.close(terminal)
        client.post(f"/jobs/{job_id}/cancel")
