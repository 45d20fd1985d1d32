"""The `export` kind: a trained job's model → a file that runs without torchyard (TorchScript,
ONNX), checked against its checkpoint (worker/kinds/export.py runs it).

- `params`: what the job stores (`ExportParams`); an export has no request of its own;
- `submit`: the API's side (`ExportCatalog`): which export job builds a (checkpoint sha256, format)
  pair, created on the first GET /jobs/{id}/export, and what that GET answers.
"""

from core.kinds.export.params import ExportParams

__all__ = ["ExportParams"]
