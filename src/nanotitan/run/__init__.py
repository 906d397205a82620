"""Processes: how a job's ranks start, and what each rank's process does before its first step.

    launch.py     start this node's ranks through torch.distributed.run, on one node or many (Slurm included)
    spawn.py      run a function on N local processes joined by one gloo group (tests, benchmarks, plan --measure)
    setup.py      one rank before its first step: identity, threads, device, emulated network, data, process groups
    rundir.py     one job owns a run dir: its lock, and no fresh run over an old run's checkpoints
    loopback.py   a one-host job listens on its loopback endpoint only (any of 127.0.0.0/8, or ::1)
    netns.py      a one-host job in a network namespace of its own: no other local user reaches its ports
    allocator.py  host allocator settings: keep a step's freed memory for the next step
"""
