"""What the library's checkpoint decisions would buy a job past this machine: a discrete-event
simulation of one checkpointed run at scale (pure Python and NumPy, no MPI, no processes).

    events.py       one run, jumped from failure to failure: versions per level, rollbacks,
                    restarts and failures during them; wall time and its split
    machine.py      a machine and a job on it -> each level's cost, time to durable and read
                    time, failure rates by class, relaunch and in-job recovery times, spares
    approaches.py   hpcckpt (the library's own per-level choice, schedule/level_intervals.py),
                    hpcckpt-l4, async-pfs and sync-pfs (daly_interval) as run plans; goodput
    scr_model.py    LLNL's SCR model's inputs as a run plan, to check the simulator against it

docs/simulation.md says what is modelled and what is not, and where each parameter comes
from; tests/test_simulate.py checks the simulator against Daly (2006) and the SCR model;
perf/project_scale.py projects goodput from 64 to 16,384 nodes.

Nothing is imported here: the command line names `hpcckpt plan`'s inputs (plan_params.py) on
every rank of every job, and only `hpcckpt plan` and the benches simulate.
"""
