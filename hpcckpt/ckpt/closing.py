"""Ending checkpointing, as the facade's close() asks it (all ranks, collectively where clean):

    the open snapshot dropped; the checkpoint in flight finished; after a clean run the
    resumed version confirmed, a version no level was due for written, the node-local versions
    L4 keeps drained to it and L4 checked to hold the newest version taken (exit 3 naming it
    otherwise), the run's summary logged, the stop reported or the memory tier given back

With an exception in flight (or close(confirm=False)) nothing collective runs after the
checkpoint in flight: the node-local versions stay where they are, and a version no level
was due for is said not to be stored.
"""

from __future__ import annotations


def close_run(ckpt, clean: bool, drain: bool, not_to_blame: bool) -> None:
    """`ckpt`: the Checkpointer; `clean`: no error is being handled; `drain`: copy the
    newest versions to L4; `not_to_blame`: the error in flight (storage, settings, another
    job) says nothing about the version the run resumed from."""
    job, taking = ckpt.job, ckpt.taking
    taking.drop_open("the checkpointer was closed with a snapshot open")
    if not_to_blame:
        ckpt.confirm_restart()
    job.tally.durable(taking.finish_in_flight())
    if clean:
        ckpt.confirm_restart()
    if drain and not ckpt.read_only:
        ckpt.drain()
        job.require_newest_on_global_levels(job.tally.last_checkpoint)
    elif taking.pending_step is not None:
        ckpt.log.warning(f"version {taking.pending_step}, the newest taken, is not stored: no level was due for it "
                         "and the run did not end cleanly")
    if clean and not ckpt.read_only:
        pipeline = job.pipeline
        job.tally.summarise(job.comm, (pipeline.versions_stored, pipeline.bytes_stored),
                            tuple(level.name for level in job.levels), pipeline.flush, pipeline.pending_replaced)
    if ckpt.stopping is not None and clean:
        job.report_stop(drained=drain)
    elif clean and drain and not ckpt.read_only:
        job.release_memory()  # finished: a stopped run's next job may read them
