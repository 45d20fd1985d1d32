"""The training loop's own speed, without the service: `Trainer.run` of one or more checkouts on the
same data, alternating, one torch thread, CPU time and images/s per epoch.

    git archive main | tar -x -C /tmp/main        # a copy of the code to compare with
    .venv/bin/python bench/loop_speed.py /tmp/main . [--rounds 3] [--epochs 16]

Each round runs every checkout once, in a fresh process (its own imports), with bench/train.py's
job settings: 2,000 `fake` images, cifar_net, SGD lr 0.001, batch 128, no validation split. It
prints, per run, the median CPU time of an epoch after the first and the best epoch's images/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r'''
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from core.kinds.train import resolve_params
from core.kinds.train import JobSpec
from worker.data.datasets import ImageTensors, load_fake
from worker.training.trainer import Trainer, plan_training
full = load_fake(3, 32, 32, seed=7)
data = ImageTensors(full.images[:2000], full.labels[:2000], full.classes)
cpu, rates, last = [], [], [time.process_time()]
class Reporter:
    def progress(self, *a): pass
    def resumed(self, *a): pass
    def notice(self, *a): pass
    def epoch(self, m):
        now = time.process_time(); cpu.append(now - last[0]); last[0] = now; rates.append(m.images_per_second)
spec = JobSpec(model="cifar_net", dataset="fake", epochs=int(sys.argv[2]), batch_size=128, optimizer="sgd",
               learning_rate=0.001, val_fraction=0.0)
plan = plan_training("bench", "cifar_net", resolve_params(spec), data, torch.device("cpu"), 3, 32, 32)
out = Path(tempfile.mkdtemp())
Trainer(plan, data, final_path=out / "m.pt", resume_path=out / "r.pt", reporter=Reporter(),
        should_stop=lambda: None).run()
steady = sorted(cpu[1:])
print(json.dumps({"cpu_ms_per_epoch_median": round(1000 * steady[len(steady) // 2], 1),
                  "best_images_per_second": max(rates[1:])}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkouts", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=16)
    args = parser.parse_args()
    for round_ in range(1, args.rounds + 1):
        for checkout in args.checkouts:
            out = subprocess.run([sys.executable, "-c", CHILD, checkout, str(args.epochs)], capture_output=True,
                                 text=True, check=True, cwd=checkout)
            print(json.dumps({"round": round_, "checkout": checkout, **json.loads(out.stdout.strip().splitlines()[-1])}),
                  flush=True)


if __name__ == "__main__":
    main()
