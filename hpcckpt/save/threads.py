"""The save pipeline's background threads: long-lived workers that run submitted jobs in order
(the copier, persist and writer threads, L4's copier), and the scheduling policy and priority
each takes as it starts (each thread sets its own: Linux schedules threads apart)."""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable

from hpcckpt.io import direct_io


class ThreadSetup:
    """`settings`: background_policy ("batch" or anything else for normal), persist_nice and
    direct_io (PipelineSettings); what cannot be set is said once in the log."""

    def __init__(self, settings, log):
        self.settings = settings
        self.log = log
        self._said: set[str] = set()

    def background(self) -> None:
        """(copier thread, and every background thread first) SCHED_BATCH: the scheduler does
        not let this thread's wake-ups (a copy job arriving, the persist's polls of MPI
        requests) preempt training; it keeps its fair share of the CPU, so it cannot hold the
        GIL or MPICH's lock for long while preempted, as a niced thread did."""
        if self.settings.background_policy != "batch":
            return
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_BATCH, os.sched_param(0))
        except (AttributeError, OSError) as exc:
            self._say_once("policy", f"cannot use SCHED_BATCH for background threads here ({exc}); they run as normal")

    def writing(self) -> None:
        """(persist, writer and L4 threads) Priority first, then the O_DIRECT bounce buffer."""
        self.background()
        nice = self.settings.persist_nice
        if nice and threading.current_thread() is not threading.main_thread():
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except (AttributeError, OSError) as exc:
                self._say_once("nice", f"cannot lower the persist thread's priority here ({exc}); it runs at "
                                       "normal priority")
        if self.settings.direct_io and direct_io.O_DIRECT:
            direct_io.reserve_bounce()

    def _say_once(self, key: str, message: str) -> None:
        if self.log and key not in self._said:
            self.log.info(message)
            self._said.add(key)

class Worker:
    """One long-lived daemon thread that runs submitted jobs in order. Starting a thread per
    checkpoint would cost a scheduling round trip (Thread.start() waits for the new thread to
    run: milliseconds on busy cores) inside the blocking time."""

    def __init__(self, name: str, on_start: Callable[[], None] | None = None):
        self.name = name
        self.on_start = on_start
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def submit(self, job: Callable, *args) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
        self.jobs.put((job, args))

    def _run(self) -> None:
        if self.on_start is not None:
            self.on_start()
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, args = item
            job(*args)  # jobs keep their own errors (see SavePipeline.worker_error)
            # Not kept while waiting for the next: a job's arguments may refer to the
            # application's arrays, whose references tell whether it still holds them.
            item = job = args = None

    def stop(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None
