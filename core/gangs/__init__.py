"""Data-parallel jobs' gangs, the core side: where to change how gangs are scheduled.

- `policy`: every rule, pure (no Redis): how many devices a gang needs, which device type it
  takes, placement order, which devices the oldest waiting gang holds, when a held device may
  still start a single-device job, the submit check, what a waiting gang's message says, and
  every gang timing;
- `records`: the gang record its ranks share (attempt, rendezvous address and secret, ready ranks,
  recorded epoch, a rank's failure) and the seat of each rank;
- `scheduler`: one pass from a worker's heartbeat: lapsed reservations undone, every rank of the
  oldest gangs reserved in one Lua script or none, holds applied, one message per rank.

The device slots these reserve and hold are core/devices/slots.py's; a rank's side is worker/gang/member.py.
"""

from core.gangs.records import GangRecords, GangState, Member, Seat
from core.gangs.scheduler import GangScheduler

__all__ = ["GangRecords", "GangScheduler", "GangState", "Member", "Seat"]
