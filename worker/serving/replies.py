"""The replies stage: a batch's probabilities → each request's top-k answer (or, for a request whose
`reply` is "probabilities", every class's probability: the Open Inference Protocol's), sent to its
API process.

Run by a decode-pool thread while the device computes the next batch (or by the device loop
itself for a batch so small that a hand-off would cost more). One top-k for a model's whole share
of the batch (the largest any of its requests asked for), sliced per request; the answer names
the alias the caller used, so the API passes it on as the HTTP body, untouched.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from core.wire import Encoding, PredictReply, PredictRequest
from worker.serving.model_cache import ResidentModel
from worker.serving.transport import Transport

log = logging.getLogger(__name__)


@dataclass
class PreparedGroup:
    """One model's share of a batch, decoded: what the device loop computes and the replies answer."""

    job_id: str
    entry: ResidentModel
    arrays: list[np.ndarray | torch.Tensor] = field(default_factory=list)  # host arrays, or rows decoded on the device
    owners: list[tuple[PredictRequest, int]] = field(default_factory=list)  # request, index of its first image
    encoding: Encoding = "image"  # what `arrays` are: decoded images (uint8) or preprocessed inputs (float32)


def send_results(transport: Transport, device_id: str, group: PreparedGroup, probabilities: torch.Tensor) -> None:
    try:
        meta = group.entry.meta
        ranked = [request for request, _ in group.owners if request.header.reply == "top_k"]
        k = min(max((request.header.top_k for request in ranked), default=1), meta.num_classes)
        values, indices = probabilities.topk(k, dim=1) if ranked else (probabilities, probabilities)
        all_values, all_indices = (values.tolist(), indices.tolist()) if ranked else ([], [])
        replies: dict[str, list[str]] = defaultdict(list)  # by inbox: one RPUSH per API process
        for request, begin in group.owners:
            header = request.header
            if header.reply == "probabilities":
                reply = PredictReply.probabilities(group.job_id, meta.architecture, device_id, meta.classes,
                                                   probabilities[begin:begin + request.image_count].tolist(),
                                                   alias=header.alias)
                replies[header.reply_to].append(reply.encode_to(header.request_id))
                continue
            top_k = min(header.top_k, meta.num_classes)
            rows = [(filename, all_indices[begin + j][:top_k], all_values[begin + j][:top_k])
                    for j, (filename, _, _) in enumerate(header.images)]
            reply = PredictReply.predictions(group.job_id, meta.architecture, device_id, meta.classes, rows,
                                             alias=header.alias)
            replies[header.reply_to].append(reply.encode_to(header.request_id))
        transport.send(replies)
    except Exception:
        log.exception("answering predictions of job %s failed", group.job_id)
