"""Images into arrays: the one image → array transform (image_array.py) every path shares, datasets
→ tensors (datasets.py), an upload decoded over every core (dataset_decode.py, forked from
forkserver.py), the batch prediction's decoding beside its forward (batch_predict_loader.py), and
normalisation (normalization.py). Nothing is imported here: decoding processes import their
modules by name and must not load torch."""
