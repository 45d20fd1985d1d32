"""Projects: `torchyard projects show NAME` (its quotas and use) and `projects set-quota NAME`
(an admin's). The API's JSON is read as dicts, as the sweeps' and keys' commands do."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from client.commands.base import EXIT_OK, Command, Group

if TYPE_CHECKING:
    from client.sdk import TorchyardClient


def _report(client: TorchyardClient, args: argparse.Namespace, project: dict[str, Any]) -> int:
    from client import output

    if args.json:
        output.emit_json(project)
        return EXIT_OK
    quota, usage = project["quota"], project["usage"]
    output.table(output.console(), ["project", "what", "uses", "quota"],
                 [[project["name"], "queued jobs", str(usage["queued_jobs"]), _limit(quota["queued_jobs"])],
                  [project["name"], "running jobs", str(usage["running_jobs"]), _limit(quota.get("running_jobs"))],
                  [project["name"], "devices held", str(usage.get("devices_held", 0)),
                   _limit(quota.get("devices_held"))],
                  [project["name"], "device-seconds today (UTC)", str(usage.get("device_seconds_today", 0)),
                   _limit(quota.get("device_seconds_per_day"))],
                  [project["name"], "jobs waiting for a quota", str(usage.get("held_jobs", 0)), "-"],
                  [project["name"], "dataset bytes", f"{usage['dataset_bytes']} ({usage['datasets']} uploads)",
                   _limit(quota["dataset_bytes"])],
                  [project["name"], "predictions per second", "-", _limit(quota.get("predict_per_second"))]])
    return EXIT_OK


def _limit(value: int | None) -> str:
    return "none" if value is None else str(value)


def _show(client: TorchyardClient, args: argparse.Namespace) -> int:
    return _report(client, args, client._request("GET", f"/projects/{args.name}").json())


def _set_quota(client: TorchyardClient, args: argparse.Namespace) -> int:
    current = client._request("GET", f"/projects/{args.name}").json()["quota"]
    for field in ("queued_jobs", "dataset_bytes", "predict_per_second", "running_jobs", "devices_held",
                  "device_seconds_per_day"):
        given = getattr(args, field)
        if given is not None:
            current[field] = None if given < 0 else given  # -1: no quota
    return _report(client, args, client._request("PUT", f"/projects/{args.name}", json=current).json())


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
