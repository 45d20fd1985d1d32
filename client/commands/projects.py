"""Projects: `torchyard projects show NAME` (its quotas and use) and `projects set-quota NAME`
(an admin's), through the SDK's calls (client/teams.py), typed with core/access/models.py."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from client.commands.base import EXIT_OK, Command, Group

if TYPE_CHECKING:
    from client.sdk import TorchyardClient
    from core.access.models import ProjectView

QUOTAS = ("queued_jobs", "dataset_bytes", "predict_per_second", "running_jobs", "devices_held",
          "device_seconds_per_day")  # core/access/models.Quota's fields, each a flag of set-quota


def _report(args: argparse.Namespace, project: ProjectView) -> int:
    from client import output

    if args.json:
        output.emit_json(project.model_dump(mode="json"))
        return EXIT_OK
    name, quota, usage = project.name, project.quota, project.usage
    output.table(output.console(), ["project", "what", "uses", "quota"],
                 [[name, "queued jobs", str(usage.queued_jobs), _limit(quota.queued_jobs)],
                  [name, "running jobs", str(usage.running_jobs), _limit(quota.running_jobs)],
                  [name, "devices held", str(usage.devices_held), _limit(quota.devices_held)],
                  [name, "device-seconds today (UTC)", str(usage.device_seconds_today),
                   _limit(quota.device_seconds_per_day)],
                  [name, "jobs waiting for a quota", str(usage.held_jobs), "-"],
                  [name, "dataset bytes", f"{usage.dataset_bytes} ({usage.datasets} uploads)",
                   _limit(quota.dataset_bytes)],
                  [name, "predictions per second", "-", _limit(quota.predict_per_second)]])
    return EXIT_OK


def _limit(value: int | None) -> str:
    return "none" if value is None else str(value)


def _show(client: TorchyardClient, args: argparse.Namespace) -> int:
    return _report(args, client.project(args.name))


def _set_quota(client: TorchyardClient, args: argparse.Namespace) -> int:
    changes = {field: None if given < 0 else given  # -1: no quota
               for field in QUOTAS if (given := getattr(args, field)) is not None}
    return _report(args, client.update_quota(args.name, **changes))


def register(command: Command, group: Group) -> None:
    projects = group("projects", _show, "a project's quotas and use: show, set-quota",
                     "Projects: each key acts in one; an admin sets their quotas (docs/security.md).")
    show = command("show", _show, "NAME's quotas and what it uses now", projects)
    show.add_argument("name")
    quota = command("set-quota", _set_quota, "set NAME's quotas (admin); the others stay as they are", projects)
    quota.add_argument("name")
    quota.add_argument("--queued-jobs", type=int, default=None, help="jobs waiting at once (-1: no quota)")
    quota.add_argument("--dataset-bytes", type=int, default=None, help="uploaded archives' bytes (-1: no quota)")
    quota.add_argument("--predict-per-second", type=int, default=None,
                       help="/predict and /v2 infer requests per second (-1: no quota)")
    quota.add_argument("--running-jobs", type=int, default=None, help="jobs running at once (-1: no quota)")
    quota.add_argument("--devices-held", type=int, default=None,
                       help="devices held at once, a gang's ranks each (-1: no quota)")
    quota.add_argument("--device-seconds-per-day", type=int, default=None,
                       help="device-seconds per UTC day (-1: no quota)")
