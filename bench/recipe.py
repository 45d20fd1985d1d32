"""Validation accuracy of the training recipe before and after, on the datasets the tests generate.

    .venv/bin/python bench/recipe.py [--seeds 0,1,2] [--recipes old,new] [--cases fake,cifar10,...]

Each case trains one model on one generated dataset, in this process, through the worker's own
code (worker/data/datasets.py's loaders, `plan_training`, `Trainer`) on the CPU, and reports the
validation accuracy of the weights the checkpoint keeps (the last epoch's for the old recipe,
the best epoch's for the new one), for each seed and their mean:

- fake: the built-in synthetic set (2,560 images, 10 classes), cifar_net;
- cifar10: tests/datagen.py's CIFAR-10 in torchvision's format (500 training images), cifar_net;
- mnist: tests/datagen.py's MNIST in torchvision's idx format (300 images), catdog_net (50×50 gray);
- shapes: tests/datagen.py's ImageFolder zip (3 classes × 60 images), catdog_net and resnet18.

Recipes: `old` is what every job ran with before docs/training.md's recipe (adam 1e-3 constant,
no weight decay, no label smoothing, the last epoch's weights): the legacy values core/kinds/train/params.py
still reads older records with. `new` is the current defaults (core/defaults.py `RECIPE`). Extra
recipes are JSON objects of JobSpec fields: --recipe 'name={"schedule": "cosine"}'.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

OLD = {"optimizer": "adam", "learning_rate": 1e-3, "schedule": "constant", "weight_decay": 0.0,
       "label_smoothing": 0.0, "patience": 0, "keep": "last", "augment": False}
RECIPES: dict[str, dict[str, Any]] = {"old": OLD, "new": {}}
# (case, dataset, model, epochs, batch size)
CASES = [("fake", "fake", "cifar_net", 1, None), ("cifar10", "cifar10", "cifar_net", 2, 32),
         ("mnist", "mnist", "catdog_net", 2, None), ("shapes", "shapes", "catdog_net", 5, 32),
         ("shapes-resnet18", "shapes", "resnet18", 2, 32)]


def _resume_file(folder: Path, epoch: int) -> Path:
    return folder / f"resume-{epoch}.pt"


class Quiet:
    def progress(self, *_: Any) -> None: ...
    def epoch(self, *_: Any) -> None: ...
    def resumed(self, *_: Any) -> None: ...
    def notice(self, *_: Any) -> None: ...


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--recipes", default="old,new")
    parser.add_argument("--recipe", action="append", default=[], help='extra: name={"field": value, ...}')
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES))
    parser.add_argument("--val-fraction", type=float, default=0.2)
    args = parser.parse_args()
    for extra in args.recipe:
        name, _, spec = extra.partition("=")
        RECIPES[name] = json.loads(spec)

    import torch

    from core.kinds.train import JobSpec, resolve_params
    from models.registry import get_model_spec
    from tests.datagen import shapes_zip, write_cifar10, write_mnist
    from worker.data.datasets import load_fake, load_image_folder, load_torchvision
    from worker.training.trainer import Trainer, plan_training

    work = Path(tempfile.mkdtemp(prefix="torchyard-recipe-"))
    write_cifar10(work / "builtin", per_batch=100)
    write_mnist(work / "builtin", train=300)
    zipfile.ZipFile(io.BytesIO(shapes_zip(per_class=60, corrupt=None, top_folder=None))).extractall(work / "shapes")

    def data(dataset: str, model: str) -> Any:
        s = get_model_spec(model).input
        if dataset == "fake":
            return load_fake(s.channels, s.height, s.width, seed=0)
        if dataset == "shapes":
            return load_image_folder(work / "shapes", s.channels, s.height, s.width)
        return load_torchvision(dataset, work / "builtin", s.channels, s.height, s.width, download=False,
                                verify_checksums=False)

    seeds = [int(s) for s in args.seeds.split(",")]
    recipes = args.recipes.split(",") + [e.partition("=")[0] for e in args.recipe]
    print(f"load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, {torch.get_num_threads()} threads",
          flush=True)
    rows = []
    try:
        for case, dataset, model, epochs, batch in CASES:
            if case not in args.cases.split(","):
                continue
            spec = get_model_spec(model).input
            for recipe in recipes:
                accuracies, seconds = [], 0.0
                for seed in seeds:
                    fields = {"model": model, "dataset": dataset, "epochs": epochs, "batch_size": batch, "seed": seed,
                              "val_fraction": args.val_fraction, **RECIPES[recipe]}
                    params = resolve_params(JobSpec(**fields))
                    tensors = data(dataset, model)
                    plan = plan_training("bench", model, params, tensors, torch.device("cpu"), spec.channels,
                                         spec.height, spec.width)
                    out = work / f"{case}-{recipe}-{seed}"
                    started = time.perf_counter()
                    result = Trainer(plan, tensors, final_path=out / "model.pt", resume_from=None,
                                     resume_to=functools.partial(_resume_file, out),
                                     reporter=Quiet(), should_stop=lambda: None, dataset=dataset).run()
                    seconds += time.perf_counter() - started
                    assert result.validation is not None
                    accuracies.append(result.validation.accuracy)
                row = {"case": case, "model": model, "epochs": epochs, "recipe": recipe,
                       "val_accuracy": [round(a, 4) for a in accuracies],
                       "mean": round(sum(accuracies) / len(accuracies), 4), "seconds": round(seconds, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print("| case | model | epochs | " + " | ".join(recipes) + " |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in recipes) + " |")
    for case, _, model, epochs, _ in CASES:
        means = {r["recipe"]: r for r in rows if r["case"] == case}
        if means:
            print(f"| {case} | {model} | {epochs} | " + " | ".join(
                f"{100 * means[r]['mean']:.1f} % ({', '.join(f'{100 * a:.0f}' for a in means[r]['val_accuracy'])})"
                for r in recipes) + " |")


if __name__ == "__main__":
    main()
