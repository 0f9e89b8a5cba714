"""A long-lived daemon thread that runs submitted jobs in order (the pipeline's copier, persist
and writer threads, L4's copier)."""

from __future__ import annotations

import queue
import threading
from typing import Callable


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

    def stop(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None
