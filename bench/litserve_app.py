"""A checkpoint behind LitServe, the peer of the /predict benches: its own decode (Pillow in
`decode_request`, no `draft`, as a LitServe user writes it), the checkpoint's preprocessing and
forward, top-5 as torchyard answers it.

    BENCH_CHECKPOINT=model.pt [BENCH_DEVICE=cuda BENCH_PRECISION=bf16] python -m bench.litserve_app PORT CONFIG_JSON

CONFIG_JSON: {"fast_queue": bool, "workers_per_device": int, "batching": bool} (bench/peers.py
sweeps them). LitServe pickles the API into its spawned inference processes, hence a class at
module level, in a module that only its server imports.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import litserve as ls
import numpy as np
import torch
from PIL import Image

from worker.checkpoints.format import load_model
from worker.data.image_array import image_to_array
from worker.data.normalization import normalize, stats_tensors

MAX_BATCH = 32  # torchyard's predict_max_batch
BATCH_TIMEOUT_S = 0.002


class ClassifierAPI(ls.LitAPI):
    def setup(self, device):
        self.device = device
        self.bf16 = os.environ.get("BENCH_PRECISION") == "bf16"
        self.model, self.meta = load_model(Path(os.environ["BENCH_CHECKPOINT"]), device)
        if self.bf16 and str(device).startswith("cuda"):
            self.model = self.model.to(memory_format=torch.channels_last)
        self.mean, self.std = stats_tensors(self.meta.preprocessing, device)

    def decode_request(self, request):
        pre = self.meta.preprocessing
        upload = request["file"]
        data = upload.file.read() if hasattr(upload, "file") else upload
        with Image.open(io.BytesIO(data)) as image:
            return image_to_array(image, pre.channels, pre.height, pre.width, pre.resize_size)

    def batch(self, inputs):
        return torch.from_numpy(np.stack(inputs))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = normalize(x.to(self.device), self.mean, self.std)
        with torch.autocast(device_type=torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.bf16):
            return torch.softmax(self.model(x).float(), dim=1).cpu()

    def predict(self, x):
        with torch.inference_mode():
            if isinstance(x, np.ndarray):  # batching off: one decoded image, `batch` not called
                return self._forward(torch.from_numpy(x)[None])[0]
            return self._forward(x)

    def unbatch(self, output):
        return list(output)

    def encode_response(self, probs):
        values, indices = probs.topk(5)
        return {"predictions": [{"label": self.meta.classes[i], "index": i, "probability": p}
                                for p, i in zip(values.tolist(), indices.tolist(), strict=True)]}


def main(port: int, config: dict) -> None:
    api = ClassifierAPI(max_batch_size=MAX_BATCH, batch_timeout=BATCH_TIMEOUT_S) if config["batching"] else ClassifierAPI()
    device = os.environ.get("BENCH_DEVICE", "cpu")
    server = ls.LitServer(api, accelerator="cuda" if device.startswith("cuda") else "cpu", devices=1,
                          workers_per_device=config["workers_per_device"], fast_queue=config["fast_queue"])
    server.run(port=port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
