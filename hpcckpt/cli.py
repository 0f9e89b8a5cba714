"""Command line: hpcckpt train | make-data (run under mpiexec for several ranks)."""

from __future__ import annotations

import os

# Ranks share a node's cores; one BLAS thread per rank avoids oversubscription and keeps
# reductions in a fixed order, so runs are bit-reproducible. Set before NumPy is imported.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

from hpcckpt.errors import HpcckptError  # noqa: E402


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", help="job TOML file (default: the embedded jobs/local.toml)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config key; VALUE is a TOML value (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcckpt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run the data-parallel training job")
    _add_config_arguments(train)
    train.add_argument("--restart", choices=("auto", "never", "require"), default="auto",
                       help="auto: resume from the newest checkpoint if any (default); require: fail if none; "
                            "never: start fresh (refuses if checkpoints exist)")
    train.add_argument("--inject", action="append", default=[], metavar="FAULT",
                       help="fault injection for tests/demos: rank-kill:rank=R:step=S[:phase=P] or "
                            "node-loss:node=N:step=S[:phase=P] (repeatable)")

    make_data = commands.add_parser("make-data", help="write a synthetic HDF5 data set (datasets x, y)")
    make_data.add_argument("-o", "--output", required=True, help="HDF5 file to write")
    make_data.add_argument("--samples", type=int, default=4096)
    make_data.add_argument("--features", type=int, default=64)
    make_data.add_argument("--classes", type=int, default=10)
    make_data.add_argument("--seed", type=int, default=0)
    return parser


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _command_train(args) -> int:
    from hpcckpt.config import load_config
    from hpcckpt.faults import parse_fault
    from hpcckpt.train.loop import run_training

    config = load_config(args.config, args.overrides)
    faults = [parse_fault(text) for text in args.inject]
    comm = _world()
    if config.cluster.simulated_nodes > comm.Get_size():
        from hpcckpt.errors import ConfigError

        raise ConfigError(
            f"{config.source}: cluster.simulated_nodes = {config.cluster.simulated_nodes} but only "
            f"{comm.Get_size()} ranks run; use at most {comm.Get_size()} or start more ranks with mpiexec -n"
        )
    run_training(config, comm, restart=args.restart, faults=faults)
    return 0


def _command_make_data(args) -> int:
    from pathlib import Path

    from hpcckpt.errors import ConfigError
    from hpcckpt.train.data import write_hdf5_dataset

    if args.samples < 2 or args.features < 1 or args.classes < 2:
        raise ConfigError("make-data: need --samples >= 2, --features >= 1, --classes >= 2")
    if Path(args.output).exists():
        raise ConfigError(f"make-data: {args.output} exists; choose another -o (nothing is overwritten)")
    write_hdf5_dataset(args.output, args.samples, args.features, args.classes, args.seed)
    print(f"wrote {args.samples} samples x {args.features} features, {args.classes} classes to {args.output}")
    return 0


COMMANDS = {"train": _command_train, "make-data": _command_make_data}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except HpcckptError as exc:
        # Errors every rank sees alike (a bad config) are printed once; exit without abort so
        # mpiexec reports the exit code instead of a kill.
        rank = _rank_or_zero()
        if exc.collective:
            if rank == 0:
                print(f"hpcckpt: error: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        print(f"hpcckpt: error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        _abort_world(exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception:
        traceback.print_exc()
        _abort_world(1)
        return 1


def _rank_or_zero() -> int:
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized():
            return MPI.COMM_WORLD.Get_rank()
    # Config errors come before MPI starts; the launcher's variables still tell the rank.
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "PALS_RANKID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _abort_world(code: int) -> None:
    """An uncaught error on one rank must not leave the others hanging in a collective."""
    if "mpi4py.MPI" not in sys.modules:
        return
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)


if __name__ == "__main__":
    raise SystemExit(main())
