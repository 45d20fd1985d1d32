"""The device a worker owns: pinning and naming it (pinning.py), what it reads live (info.py), its
health (health.py), who gets the host's cores (cpu_threads.py), and the host buffers its copies go
through (pinned_ring.py). Nothing is imported here: pinning runs before torch may load."""
