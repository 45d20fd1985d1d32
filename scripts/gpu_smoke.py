"""GPU smoke test: the real product path on a machine with NVIDIA GPUs.

Starts `torchyard up` (embedded Redis, the API, one worker per GPU) on a fresh data dir, trains
cifar_net and resnet18 on the synthetic `fake` dataset on CUDA, predicts with each, checks that
/devices names the real GPU with its memory, that each job ran on CUDA with the precision its
compute capability calls for (bf16 autocast from 8.0, fp16 with a GradScaler on 7.x) and
channels_last, that each model was served by its traced graph (none fell back to eager), that each checkpoint loads in a CPU-only process, prints training
images/s, then stops everything and checks that nothing it started is left running.

    scripts/gpu-smoke.sh                      # on a GPU machine
    scripts/gpu-smoke.sh --allow-cpu          # anywhere: tests this script on the CPU worker

Exit 0 when every check passed; 1 with the failed check otherwise.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the stack harness (harness/) and the product, from this checkout

from harness import cli, free_port, kill_group, spawn, without_settings  # noqa: E402


class SmokeFailure(AssertionError):
    pass


def check(condition: object, message: str) -> None:
    if not condition:
        raise SmokeFailure(message)
    print(f"  ok  {message}", flush=True)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SmokeFailure(f"timed out after {timeout:.0f}s waiting for {what}")


def pattern_png(label: int, channels: int, size: int) -> bytes:
    """An image drawn from the `fake` dataset's class pattern, as a PNG upload."""
    import torch
    from PIL import Image

    from worker.data.datasets import fake_images

    image = fake_images(torch.tensor([label]), channels, size, size, seed=4242)[0]
    array = image.permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(array[..., 0] if channels == 1 else array).save(buffer, format="PNG")
    return buffer.getvalue()


def load_on_cpu_only(path: Path) -> dict:
    """torch.load in a fresh process that can see no GPU at all."""
    code = ("import json, sys, torch\n"
            "p = torch.load(sys.argv[1], map_location='cpu', weights_only=True)\n"
            "devices = {str(t.device) for t in p['state_dict'].values()}\n"
            "print(json.dumps({'architecture': p['meta']['architecture'], 'devices': sorted(devices), "
            "'cuda_available': torch.cuda.is_available(), 'tensors': len(p['state_dict'])}))\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    if out.returncode != 0:
        raise SmokeFailure(f"checkpoint {path} did not load on a CPU-only process:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compute_capability(pinned: str) -> tuple[int, int]:
    """The compute capability of the GPU a worker was pinned to (its CUDA_VISIBLE_DEVICES entry: an
    index in PCI order, or a UUID), asked of torch in a fresh process pinned the same way."""
    code = "import torch; print(*torch.cuda.get_device_capability(0))"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": pinned, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SmokeFailure(f"could not read the compute capability of GPU {pinned}:\n{out.stderr}")
    major, minor = out.stdout.split()
    return int(major), int(minor)


def expected_amp_dtype(capability: tuple[int, int]) -> str | None:
    """worker/training/recipe.choose_precision's rule, restated: bf16 from 8.0, fp16 on 7.x, none before."""
    if capability >= (8, 0):
        return "bfloat16"
    return "float16" if capability >= (7, 0) else None


def run(args: argparse.Namespace) -> int:
    has_gpu = shutil.which("nvidia-smi") is not None
    if not has_gpu and not args.allow_cpu:
        print("no nvidia-smi on this machine: no NVIDIA GPU to test. Use --allow-cpu to test the "
              "script itself on the CPU worker.", file=sys.stderr)
        return 2
    gpu_mode = has_gpu  # --allow-cpu only allows the CPU where there is no GPU; it never skips one
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="torchyard-gpu-smoke-"))
    port = args.port or free_port()
    env = without_settings()  # embedded Redis, our dir
    env.update(TORCHYARD_DATA_DIR=str(data_dir), TORCHYARD_PORT=str(port), TORCHYARD_HOST="127.0.0.1",
               TORCHYARD_DEVICES=args.devices, PYTHONUNBUFFERED="1")
    log_path = data_dir / "up.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    print(f"torchyard up: data dir {data_dir}, API on 127.0.0.1:{port}, log {log_path}", flush=True)
    up = spawn(cli("up"), log_path, env)
    started: dict[int, psutil.Process] = {}
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    summary: dict = {"mode": "cuda" if gpu_mode else "cpu", "jobs": []}
    try:
        wait_for(lambda: client.get("/readyz").status_code == 200, args.start_timeout, "API and a worker heartbeat")
        started = {p.pid: p for p in psutil.Process(up.pid).children(recursive=True)}

        print("devices:", flush=True)
        listed = client.get("/devices").json()["devices"]
        for device in listed:
            print(f"  {device['id']}: {device['name']}, {device['memory_total_bytes'] / 2**30:.1f} GiB total, "
                  f"{(device['memory_used_bytes'] or 0) / 2**30:.1f} GiB used, utilisation "
                  f"{device['utilization_percent']}%, CUDA_VISIBLE_DEVICES={device.get('cuda_visible_devices')!r}, "
                  f"{device['status']}", flush=True)
        summary["devices"] = listed
        kind = "cuda" if gpu_mode else "cpu"
        mine = [d for d in listed if d["type"] == kind and d["status"] != "offline"]
        check(mine, f"/devices lists a live {kind} device")
        for device in mine:
            check(device["name"] and device["memory_total_bytes"] > 0,
                  f"{device['id']} has a name ({device['name']}) and memory ({device['memory_total_bytes']} bytes)")
            if gpu_mode:
                named = device["index"] if device["index"] is not None else device["cuda_visible_devices"]
                check(device["id"].endswith(f"/cuda:{named}"),
                      f"{device['id']} is named by its physical index (or UUID), worker {device['worker']}")
                check(device["cuda_visible_devices"] == str(named),
                      f"{device['worker']} pinned with CUDA_VISIBLE_DEVICES={named}")

        for model in args.models:
            spec = {"model": model, "dataset": "fake", "epochs": args.epochs, "device": kind}
            created = client.post("/jobs", json=spec)
            check(created.status_code == 202, f"POST /jobs {model} accepted ({created.status_code})")
            job_id = created.json()["id"]
            job = wait_for(lambda job_id=job_id: (j := client.get(f"/jobs/{job_id}").json())["status"]
                           in ("succeeded", "failed", "cancelled") and j, args.job_timeout, f"job {job_id}")
            check(job["status"] == "succeeded", f"{model} job {job_id} succeeded (error: {job['error']})")
            params = {**job["params"], **(job.get("device_choices") or {})}  # what it ran with
            if gpu_mode:
                check("/cuda:" in job["device"], f"{model} ran on {job['device']}")
                check(str(params.get("device", "")).startswith("cuda"), f"{model} trained on torch device {params.get('device')}")
                check("amp_dtype" in params and "channels_last" in params,
                      f"{model} recorded amp_dtype={params.get('amp_dtype')} channels_last={params.get('channels_last')}")
                check(params.get("channels_last") is True, f"{model} used channels_last")
                ran_on = next(d for d in mine if d["id"] == job["device"])
                capability = compute_capability(str(ran_on["cuda_visible_devices"]))
                wanted = expected_amp_dtype(capability)
                check(params.get("amp_dtype") == wanted,
                      f"{model} on compute capability {capability[0]}.{capability[1]} trained with amp_dtype "
                      f"{params.get('amp_dtype')} (wanted {wanted})")
                check(params.get("grad_scaler") is (wanted == "float16"),
                      f"{model}'s GradScaler {'on' if params.get('grad_scaler') else 'off'} for {wanted}")
            else:
                check(job["device"].endswith("/cpu"), f"{model} ran on {job['device']}")
                check("amp_dtype" in params and "channels_last" in params, f"{model} recorded amp/channels_last")
            last = job["metrics"][-1]
            print(f"  {model}: {last['images_per_second']:.0f} training images/s (epoch {last['epoch']}), "
                  f"val_accuracy {last['val_accuracy']:.3f}, batch {params.get('batch_size')}, "
                  f"amp {params.get('amp_dtype')}, channels_last {params.get('channels_last')}", flush=True)

            channels = 3
            size = int(params.get("image_size") or params.get("height") or 32)
            answer = client.post("/predict", data={"job_id": job_id, "top_k": "1"},
                                 files={"file": ("three.png", pattern_png(3, channels, size), "image/png")})
            check(answer.status_code == 200, f"{model} predicted ({answer.status_code} {answer.text[:200]})")
            body = answer.json()
            check(body["device"] == job["device"], f"{model} prediction served on {body['device']}")
            if gpu_mode:
                # The heartbeat's inference stats count the models served eagerly (their trace was
                # refused: worker/checkpoints/forward_graph.py); a GPU model must be served by its traced graph.
                def served(device_id: str = job["device"]) -> dict | None:
                    record = next((d for d in client.get("/devices").json()["devices"] if d["id"] == device_id), None)
                    cache = ((record or {}).get("inference") or {}).get("cache") or {}
                    return cache if cache.get("loads", 0) >= 1 else None

                cache = wait_for(served, 30, f"{job['device']}'s heartbeat to show the loaded model")
                check(cache.get("eager") == 0,
                      f"{model} served by its traced graph on the GPU (eager models on {job['device']}: "
                      f"{cache.get('eager')}; the worker's log says why)")

            download = client.get(f"/jobs/{job_id}/checkpoint")
            check(download.status_code == 200, f"{model} checkpoint downloads ({len(download.content)} bytes)")
            local = data_dir / f"{model}-{job_id}.pt"
            local.write_bytes(download.content)
            loaded = load_on_cpu_only(local)
            check(loaded["architecture"] == model and loaded["devices"] == ["cpu"] and not loaded["cuda_available"],
                  f"{model} checkpoint loads with torch.load(map_location='cpu', weights_only=True) where no GPU is visible")
            summary["jobs"].append({"model": model, "id": job_id, "device": job["device"],
                                    "images_per_second": [m["images_per_second"] for m in job["metrics"]],
                                    "amp_dtype": params.get("amp_dtype"), "channels_last": params.get("channels_last"),
                                    "batch_size": params.get("batch_size"), "val_accuracy": last["val_accuracy"]})
    finally:
        client.close()
        if not started and up.poll() is None:
            started = {p.pid: p for p in psutil.Process(up.pid).children(recursive=True)}
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        try:
            code = up.wait(args.stop_timeout)
        except subprocess.TimeoutExpired:
            kill_group(up.pid)
            up.wait()
            raise SmokeFailure("torchyard up did not stop within the timeout after SIGTERM") from None
        left = [p for p in started.values() if _running(p)]
        for proc in left:
            proc.kill()
    check(code == 0, f"torchyard up exited 0 after SIGTERM (got {code})")
    check(not left, f"nothing left running ({len(started)} child processes all gone)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if not args.data_dir:
        shutil.rmtree(data_dir, ignore_errors=True)
    print("GPU SMOKE PASSED" if gpu_mode else "SMOKE PASSED (CPU mode: no GPU was tested)", flush=True)
    return 0


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU worker (no GPU checks): to test this script on any machine")
    parser.add_argument("--models", default="cifar_net,resnet18", type=lambda s: [m for m in s.split(",") if m])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--devices", default="auto", help="TORCHYARD_DEVICES for `up` (auto, cpu, 0,1, ...)")
    parser.add_argument("--data-dir", help="default: a new temporary directory")
    parser.add_argument("--port", type=int)
    parser.add_argument("--json", help="write a summary (devices, jobs, images/s) to this file")
    parser.add_argument("--start-timeout", type=float, default=180)
    parser.add_argument("--job-timeout", type=float, default=900)
    parser.add_argument("--stop-timeout", type=float, default=120)
    args = parser.parse_args(argv)
    if args.devices == "auto" and shutil.which("nvidia-smi") is None:
        args.devices = "cpu"
    try:
        return run(args)
    except SmokeFailure as failure:
        print(f"FAILED: {failure}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
