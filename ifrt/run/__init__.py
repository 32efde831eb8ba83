"""``ifrt run``: one agent per host that starts the job's workers and restarts the whole job in place, as the
coordinator's next attempt, when a process fails anywhere (see docs/failures.md).

    ifrt run --nproc-per-host 2 --max-restarts 3 -- python train.py     # on every host

Modules: ``agent`` (the decisions, pure), ``workers`` (processes, output, signals), ``job`` (the coordinator),
``shell`` (flags and the event loop).
"""
