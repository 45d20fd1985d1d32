"""The audit log: who (key id and name) did what (method, route, object, result) and when.

One capped Redis stream (ty:audit): XADD with an approximate MAXLEN (TORCHYARD_AUDIT_MAX_ENTRIES)
keeps it bounded however busy the service, and the retention cleanup (core/retention.py) trims
entries older than TORCHYARD_KEEP_AUDIT_DAYS by stream id (ids are Redis's clock in ms). A stream,
not a list: its ids are time-ordered, so paging (`before`) and trimming by age need no index.

What is recorded is decided by the API's gate (app/api/access.py): every request that may change
something (not GET/HEAD/OPTIONS; the prediction routes excepted: they change nothing and are the
hot path) and every 403, whatever its method. A 401 is not (it has no key to name, and an
unauthenticated flood must not push real entries out of a capped log): the access log has those.
Writing an entry never fails the request it records.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import redis
import redis.asyncio as aioredis

from core import keys
from core.access.keystore import Principal
from core.access.models import AuditEntry
from core.access.roles import Role
from core.clock import utc_now_iso

DAY_MS = 86_400_000


def entry_fields(principal: Principal, method: str, route: str, obj: str | None, status: int) -> dict[str, str]:
    return {"at": utc_now_iso(), "key_id": principal.key_id or "", "key_name": principal.name,
            "project": principal.project, "role": principal.role.value, "method": method, "route": route,
            "object": obj or "", "status": str(status)}


async def record(client: aioredis.Redis, max_entries: int, fields: dict[str, str]) -> None:
    await client.xadd(keys.AUDIT, fields, maxlen=max_entries, approximate=True)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read(client: redis.Redis, limit: int, before: str | None = None) -> list[AuditEntry]:
    """The newest `limit` entries, newest first; `before`: only entries older than that id."""
    top = f"({before}" if before else "+"
    rows = client.xrevrange(keys.AUDIT, max=top, min="-", count=limit)
    out = []
    for entry_id, raw in rows:
        fields = {_text(k): _text(v) for k, v in raw.items()}
        out.append(AuditEntry(id=_text(entry_id), at=datetime.fromisoformat(fields["at"]),
                              key_id=fields["key_id"] or None, key_name=fields["key_name"],
                              project=fields["project"], role=Role(fields["role"]), method=fields["method"],
                              route=fields["route"], object=fields["object"] or None, status=int(fields["status"])))
    return out


def trim(client: redis.Redis, now_s: float, keep_days: float) -> int:
    """Drop entries older than `keep_days` (0: keep until the cap pushes them out); how many went."""
    if keep_days <= 0:
        return 0
    oldest_ms = int(now_s * 1000 - keep_days * DAY_MS)
    return int(client.xtrim(keys.AUDIT, minid=f"{max(0, oldest_ms)}-0"))

