"""Access: API keys with roles, and the audit log (issue #38's first slice; docs/security.md).

- `roles`: the four roles, their abilities, and THE table of what every operation needs (pure);
- `models`: the keys' and the audit log's side of the HTTP contract;
- `keystore`: keys created, listed and revoked; a secret checked against its salted hash (Principal);
- `audit`: the capped stream of who did what, read by GET /audit and trimmed by retention.

The API applies all of it in app/api/access.py (the gate's key check, the per-route dependency,
the audit record); nothing here imports a web framework.
"""
