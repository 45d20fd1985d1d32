"""A data-parallel job, the worker's side: one rank (rank.py), the member of a gang inside a worker
(member.py, which needs of the job runner only the `Runner` protocol of runner.py), a rank's
training (training.py) and the collectives (collectives.py). Nothing is imported here: a room's
modules are imported by name."""
