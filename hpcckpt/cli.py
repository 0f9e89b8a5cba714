"""Command line: hpcckpt train | evaluate | inspect | report | verify | export | halt | exec | make-data |
clean-shm | plan (run train, evaluate and exec under mpiexec for several ranks)."""

from __future__ import annotations

import os

# Ranks share a node's cores; one BLAS thread per rank avoids oversubscription and keeps
# reductions in a fixed order, so runs are bit-reproducible. Set before NumPy is imported.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402


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
    train.add_argument("--init-from", metavar="RUN_DIR_OR_VERSION", default=None,
                       help="a new run starts from another run's model weights: its run directory (newest L4 "
                            "version), its PFS directory, or one version directory there; step, data order and "
                            "optimizer start fresh. Ignored once this run has a checkpoint of its own")
    train.add_argument("--init-optimizer", action="store_true",
                       help="with --init-from: load the optimizer state (momentum etc.) too")
    train.add_argument("--inject", action="append", default=[], metavar="FAULT",
                       help="fault injection for tests/demos: rank-kill:rank=R:step=S[:phase=P][:attempt=A] or "
                            "node-loss:node=N:step=S[:phase=P][:attempt=A] (repeatable; attempt=A: only in attempt "
                            "A of a job script's restart loop)")

    inspect = commands.add_parser("inspect", help="list checkpoint versions per level")
    _add_config_arguments(inspect)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")

    export = commands.add_parser("export", help="write one version's full tensors to a self-describing HDF5 file")
    _add_config_arguments(export)
    export.add_argument("--version", default="latest", help="latest | best | STEP (default latest)")
    export.add_argument("-o", "--output", required=True, help="HDF5 file to write (never overwritten)")

    evaluate = commands.add_parser("evaluate", help="evaluate a checkpoint on the validation set (run under mpiexec, "
                                                    "any number of ranks)")
    _add_config_arguments(evaluate)
    evaluate.add_argument("--version", default="latest", help="latest | best | STEP (default latest)")

    report = commands.add_parser("report", help="summarise a run across its attempts: restarts, where shards "
                                                "came from, checkpoints, work lost")
    _add_config_arguments(report)

    verify = commands.add_parser("verify", help="check the checksum of every stored piece")
    _add_config_arguments(verify)

    clean_shm = commands.add_parser(
        "clean-shm", help="delete the shared-memory segments killed MPI ranks left in /dev/shm on this node "
                          "(ours, open or mapped by no process)")
    clean_shm.add_argument("--dry-run", action="store_true", help="list them without deleting")
    clean_shm.add_argument("--newer-than", type=float, metavar="EPOCH_SECONDS",
                           help="only segments last modified at or after this time (e.g. the failed job's start)")

    halt = commands.add_parser(
        "halt", help="ask the job running a run to stop cleanly after its current step (writes <run.dir>/HALT: "
                     "final checkpoint, drained to L4, exit 75)")
    _add_config_arguments(halt)
    halt.add_argument("--run-dir", help="the run directory (default: run.dir of the config)")
    halt.add_argument("--reason", default="", help="a line for the job's log")
    halt.add_argument("--remove", action="store_true", help="take a halt request back before the job saw it")

    run_app = commands.add_parser(
        "exec", help="run an application (any SPMD program that uses the hpcckpt library) on this rank after the "
                     "MPI start-up settings hpcckpt train makes: the job scripts start APP this way")
    run_app.add_argument("command_line", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]")

    make_data = commands.add_parser("make-data", help="write a synthetic HDF5 data set (datasets x, y)")
    make_data.add_argument("-o", "--output", required=True, help="HDF5 file to write")
    make_data.add_argument("--samples", type=int, default=4096)
    make_data.add_argument("--features", type=int, default=64)
    make_data.add_argument("--classes", type=int, default=10)
    make_data.add_argument("--seed", type=int, default=0)
    make_data.add_argument("--clicks", action="store_true",
                           help="a click data set for the embedding model: --features dense features, --fields "
                                "categorical ids per sample (dataset 'ids'), 0/1 labels")
    make_data.add_argument("--fields", type=int, default=8)
    make_data.add_argument("--vocabulary", type=int, default=20000)

    _add_plan_parser(commands)
    return parser


def _add_plan_parser(commands) -> None:
    from hpcckpt.simulate.plan_params import PARAMS

    plan = commands.add_parser(
        "plan", help="for a site's machine and failure rates: the levels and intervals the library would choose, "
                     "the goodput simulated, the spares to hold and the config lines to paste (no MPI)",
        description="Anything not given is assumed (an H100 cluster as Llama 3 ran it) and said so. Sizes take "
                    "B, kB, MB, GB, TB or KiB ... PiB; bandwidths the same per second (GB/s) or bits (Gb/s); "
                    "durations s, min, h, d or w; an MTBF may be none.")
    plan.add_argument("-c", "--config", help="TOML file whose [plan] table gives any of the values below by the "
                                             "same names (nodes = 2048, pfs_write_bw = \"2TB/s\"); flags override it")
    for param in PARAMS:
        plan.add_argument(param.flag, dest=param.name, metavar="VALUE", help=f"{param.help} (e.g. {param.example})")
    plan.add_argument("--json", action="store_true", help="machine-readable output")


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _command_train(args) -> int:
    from hpcckpt.config import load_config
    from hpcckpt.exit_record import record_started
    from hpcckpt.faults import parse_fault
    from hpcckpt.train.loop import run_training

    config = load_config(args.config, args.overrides)
    faults = [parse_fault(text) for text in args.inject]
    comm = _world()
    record_started(comm)
    spares = config.resilience.spares
    workers = comm.Get_size() - spares
    if workers < 1:
        from hpcckpt.errors import ConfigError

        raise ConfigError(f"{config.origin('resilience.spares')}: resilience.spares = {spares} but the job has "
                          f"{comm.Get_size()} rank(s): mpiexec -n counts the spares too; start more ranks or hold "
                          f"fewer spares")
    if config.cluster.simulated_nodes > workers:
        from hpcckpt.errors import ConfigError

        spared = f" besides the {spares} spare(s)" if spares else ""
        raise ConfigError(
            f"{config.origin('cluster.simulated_nodes')}: cluster.simulated_nodes = {config.cluster.simulated_nodes} "
            f"but only {workers} ranks run{spared}; use at most {workers} or start more ranks with mpiexec -n"
        )
    _check_fault_targets(faults, config, comm, workers)
    if args.init_optimizer and not args.init_from:
        from hpcckpt.errors import ConfigError

        raise ConfigError("--init-optimizer needs --init-from RUN_DIR_OR_VERSION")
    from hpcckpt.run.in_job import run_surviving
    from hpcckpt.run.in_job_state import recoveries_in_job

    def train(comm):
        # After ranks died, the survivors go on from the newest version they can get, or from the
        # start where the run had none yet (as a relaunch with --restart auto would).
        restart = "auto" if recoveries_in_job() else args.restart
        return run_training(config, comm, restart=restart, faults=faults, init_from=args.init_from,
                            init_optimizer=args.init_optimizer)

    summary = run_surviving(train, comm, spares=spares, shrink=config.resilience.out_of_spares == "shrink")
    if summary is None:  # an idle spare, released at the end: the workers' summary says how it went
        return 0
    if summary.halted:
        from hpcckpt.schedule.stopping import EXIT_HALTED

        return EXIT_HALTED
    return 0


def _check_fault_targets(faults, config, comm, size: int) -> None:
    """A fault aimed at a rank or node the job does not have would never fire, and a test or
    demo relying on it would pass for the wrong reason. `size`: the ranks that run main (the
    spares do not)."""
    from hpcckpt.errors import ConfigError

    for fault in faults:
        if fault.kind != "node-loss" and fault.target != -1 and not 0 <= fault.target < size:
            raise ConfigError(f"--inject {fault.kind}:rank={fault.target}: this job has ranks 0 to {size - 1}; "
                              "choose one of them")
    if not any(f.kind == "node-loss" for f in faults):
        return
    if config.cluster.simulated_nodes:
        nodes, kind = config.cluster.simulated_nodes, "simulated node(s) (cluster.simulated_nodes)"
    else:
        from hpcckpt.cluster.placement import discover_topology

        nodes, kind = len(set(discover_topology(comm, 0).node_of_rank)), "node(s)"
    for fault in faults:
        if fault.kind == "node-loss" and not 0 <= fault.target < nodes:
            raise ConfigError(f"--inject node-loss:node={fault.target}: this job has {nodes} {kind}, "
                              f"numbered 0 to {nodes - 1}; choose one of them")


def _output_path(command: str, output: str):
    """Check -o before any work: a missing or read-only directory would otherwise surface only
    at the end, as a traceback from HDF5."""
    from pathlib import Path

    from hpcckpt.errors import ConfigError

    path = Path(output)
    if path.exists():
        raise ConfigError(f"{command}: {path} exists; choose another -o (nothing is overwritten)")
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"{command}: cannot write {path}: directory {parent} does not exist; "
                          "create it or choose another -o")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{command}: cannot write {path}: directory {parent} is not writable; choose another -o")
    return path


def _write_via_temporary(command: str, path, write) -> None:
    """write(temporary), then rename it to `path`: a failed write leaves neither a partial
    file under the real name nor the temporary one."""
    from hpcckpt.errors import StorageError

    temporary = path.with_name(path.name + ".tmp")
    try:
        write(temporary)
        temporary.rename(path)
    except BaseException as exc:
        temporary.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise StorageError(f"{command}: writing {path} failed: {exc.strerror or exc}") from None
        raise


def _command_make_data(args) -> int:
    from hpcckpt.errors import ConfigError
    from hpcckpt.train.data import write_hdf5_clicks, write_hdf5_dataset

    if args.samples < 2 or args.features < 1 or args.classes < 2:
        raise ConfigError("make-data: need --samples >= 2, --features >= 1, --classes >= 2")
    output = _output_path("make-data", args.output)
    if args.clicks:
        if args.fields < 1 or args.vocabulary < 1:
            raise ConfigError("make-data --clicks: need --fields >= 1 and --vocabulary >= 1")
        _write_via_temporary("make-data", output, lambda temporary: write_hdf5_clicks(
            str(temporary), args.samples, args.features, args.fields, args.vocabulary, args.seed))
        print(f"wrote {args.samples} clicks: {args.features} dense features and {args.fields} categorical field(s) "
              f"of {args.vocabulary} ids to {args.output}")
        return 0
    _write_via_temporary("make-data", output, lambda temporary: write_hdf5_dataset(
        str(temporary), args.samples, args.features, args.classes, args.seed))
    print(f"wrote {args.samples} samples x {args.features} features, {args.classes} classes to {args.output}")
    return 0


def _command_inspect(args) -> int:
    import dataclasses
    import json

    from hpcckpt.tools.catalog import l4_lag, version_overview
    from hpcckpt.config import load_config
    from hpcckpt.levels.naming import LEVEL_NUMBERS

    config = load_config(args.config, args.overrides)
    versions = version_overview(config)
    if args.json:
        print(json.dumps([dataclasses.asdict(v) for v in versions], indent=1))
        return 0
    if not versions:
        print(f"no checkpoint versions under {config.run.dir!r}")
        return 0
    width = 34 if any(v.domains for v in versions) else 18
    print(f"{'step':>8} {'levels':12} {'ranks':>5} {'size':>12}  {'survives':{width}} {'restart onto':12} metrics")
    for v in versions:
        levels = " ".join(LEVEL_NUMBERS[level] for level in v.levels) or ("rebuildable" if v.assembled_from else "incomplete")
        survives = "any node losses" if v.survives is None else f"{v.survives} node loss(es)"
        if v.domains:
            survives += (", any domain losses" if v.survives_domains is None else
                         f", {v.survives_domains} of {v.domains} domains")
        onto = {"any": "any ranks", "": "-"}.get(v.restart_ranks, f"{v.restart_ranks} ranks")
        metrics = " ".join(f"{k}={x:.4g}" for k, x in v.metrics.items() if isinstance(x, (int, float)) and k != "step")
        print(f"{v.step:8d} {levels:12} {v.world_size or '?':>5} {v.size:12,d}  {survives:{width}} {onto:12} {metrics}")
        if not v.levels and v.assembled_from:
            print(f"{'':8} some ranks' node-local files are gone (a lost node, or one that could not take it); a restart assembles it: old shards {v.assembled_from}")
    if "pfs" in config.resilience.levels:
        print(l4_lag(versions))
    return 0


def _command_export(args) -> int:
    import h5py

    from hpcckpt.tools.catalog import manifest_of, read_full_tables, read_full_tensors, resolve_version
    from hpcckpt.config import load_config
    from hpcckpt.format.keyed_rows import piece_names

    config = load_config(args.config, args.overrides)
    output = _output_path("export", args.output)
    step = resolve_version(config, args.version)
    manifest = manifest_of(config, step)
    tensors = read_full_tensors(config, manifest)
    for name, (ids, rows) in read_full_tables(config, manifest).items():  # whole, by id, chain applied
        tensors.update(zip(piece_names(name), (ids, rows)))

    def write(temporary):
        with h5py.File(temporary, "w") as f:
            f.attrs["step"] = manifest.step
            f.attrs["world_size"] = manifest.world_size
            f.attrs["hpcckpt_version"] = __import__("hpcckpt").__version__
            for key, value in manifest.metrics.items():
                if isinstance(value, (int, float)):
                    f.attrs[f"metric_{key}"] = value
            for name, array in tensors.items():
                f.create_dataset(name, data=array)

    _write_via_temporary("export", output, write)
    total = sum(a.nbytes for a in tensors.values())
    print(f"exported version {step} ({len(tensors)} tensors, {total:,} bytes) to {output}")
    return 0


def _command_evaluate(args) -> int:
    import dataclasses

    from hpcckpt.tools.catalog import resolve_version
    from hpcckpt.ckpt.engine import Checkpointer
    from hpcckpt.cluster.backend import select_backend
    from hpcckpt.cluster.collectives import on_root
    from hpcckpt.cluster.placement import discover_topology
    from hpcckpt.config import load_config
    from hpcckpt.runlog import RunLog
    from hpcckpt.train.trainer import Trainer

    config = load_config(args.config, args.overrides)
    # Evaluation only reads (restore(wanted=step) repairs nothing): node-local copies (same rank
    # count) or L4 (any rank count), so it needs no partner map or erasure groups, and runs on
    # any number of ranks.
    readable = tuple(level for level in config.resilience.levels if level in ("local", "pfs"))
    config = config.replace(resilience=dataclasses.replace(config.resilience, levels=readable or ("pfs",)))
    comm = _world()
    # Rank 0 decides which version (ranks may see different node-local directories); an error
    # there is raised on every rank so the job ends together with one message.
    step = on_root(comm, "finding the version to evaluate", lambda: resolve_version(config, args.version))
    topology = discover_topology(comm, config.cluster.simulated_nodes, config.cluster.failure_domains,
                                  config.cluster.simulated_domains)
    log = RunLog(config.run.dir, comm.Get_rank(), comm.Get_size())
    try:
        backend = select_backend(config.run.device, topology.local_index(comm.Get_rank()))
        trainer = Trainer(config, comm, backend, log)
        checkpointer = Checkpointer(comm, config, topology=topology, log=log, read_only=True)
        try:
            for name, array in trainer.protected_arrays():
                checkpointer.protect(name, array)
            checkpointer.register_state("trainer", trainer.training_state, trainer.load_training_state)
            checkpointer.restart("require", step=step)
        finally:
            checkpointer.close()
        result = trainer.evaluate()
        log.info(f"version {step}: val_loss {result['val_loss']:.4f}  val_accuracy "
                 f"{100 * result['val_accuracy']:.2f} %  ({comm.Get_size()} ranks)", console=True)
    finally:
        log.close()
    return 0


def _command_report(args) -> int:
    from hpcckpt.config import load_config
    from hpcckpt.tools.report import read_records, summarise

    config = load_config(args.config, args.overrides)
    damaged: list[int] = []
    records = read_records(config.run.dir, damaged)
    print(f"run {config.run.dir}:")
    for line in summarise(records):
        print("  " + line)
    if damaged:
        shown = ", ".join(map(str, damaged[:10])) + (" ..." if len(damaged) > 10 else "")
        print(f"  note: {len(damaged)} damaged line(s) of metrics.jsonl skipped (line {shown}): a crash cut them "
              "short, or the file was damaged; the rest is told above")
    return 0


def _command_verify(args) -> int:
    from hpcckpt.tools.catalog import verify_all
    from hpcckpt.config import load_config

    config = load_config(args.config, args.overrides)
    checked, problems, notes = verify_all(config)
    for line in notes + problems:
        print(line)
    print(f"verified {checked} checkpoint file(s): {'all good' if not problems else f'{len(problems)} problem(s)'}")
    return 0 if not problems else 1


def _command_plan(args) -> int:
    import json

    from hpcckpt.simulate.plan import PARAMS, make_plan, read_settings, render, to_json

    settings = read_settings({param.name: getattr(args, param.name) for param in PARAMS}, args.config)
    plan = make_plan(settings)
    print(json.dumps(to_json(plan), indent=1) if args.json else render(plan))
    return 0


def _command_clean_shm(args) -> int:
    from hpcckpt.cluster.shm_orphans import find_orphans, remove_orphans

    since = args.newer_than
    found = find_orphans(newer_than=since) if args.dry_run else remove_orphans(newer_than=since)
    for path in found.paths:
        print(path)
    if found.uninspected and found.paths:
        print(f"clean-shm: note: could not inspect process(es) {', '.join(found.uninspected[:5])}; a segment "
              "only they use would look orphaned (limit the age with --newer-than)")
    verb = "would delete" if args.dry_run else "deleted"
    print(f"clean-shm: {verb} {len(found.paths)} orphaned MPI segment(s), {found.nbytes / 2**20:.1f} MiB")
    return 0


def _command_halt(args) -> int:
    from pathlib import Path

    from hpcckpt.schedule.stopping import HALT_FILE_NAME
    from hpcckpt.config import load_config
    from hpcckpt.errors import ConfigError

    run_dir = Path(args.run_dir or load_config(args.config, args.overrides).run.dir)
    path = run_dir / HALT_FILE_NAME
    if args.remove:
        path.unlink(missing_ok=True)
        print(f"removed {path}")
        return 0
    if not run_dir.is_dir():
        raise ConfigError(f"halt: {run_dir} is not a run directory (it does not exist); pass the run's --run-dir")
    path.write_text((args.reason or "hpcckpt halt") + "\n")
    print(f"wrote {path}: the job stops after its current step (rank 0 looks for it about once a second and "
          "at every checkpoint), takes a final checkpoint, copies it to L4 and exits 75; the file is removed then")
    return 0


def _command_exec(args) -> int:
    """Become the application (os.execvp: same process, so the launcher's signals reach it)
    once the MPI start-up settings are made, which must precede MPI_Init."""
    from hpcckpt.errors import ConfigError

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not command:
        raise ConfigError("exec: name the application to run, e.g. hpcckpt exec python examples/heat2d.py "
                          "--run-dir run")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        raise ConfigError(f"exec: cannot run {command[0]!r}: {exc.strerror or exc}; check APP (or the command "
                          "line) and the PATH") from None
    return 1  # not reached: execvp returns only by raising


COMMANDS = {"clean-shm": _command_clean_shm, "exec": _command_exec, "halt": _command_halt, "train": _command_train, "make-data": _command_make_data,
            "inspect": _command_inspect, "export": _command_export, "evaluate": _command_evaluate,
            "verify": _command_verify, "report": _command_report, "plan": _command_plan}


def main(argv=None) -> int:
    from hpcckpt.application import run_main

    args = build_parser().parse_args(argv)
    return run_main(lambda: COMMANDS[args.command](args))


if __name__ == "__main__":
    raise SystemExit(main())
