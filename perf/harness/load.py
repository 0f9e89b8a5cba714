"""How busy the machine was during a benchmark: other runnable processes and the load average.

Shared development machines run other jobs; benchmarks report this next to their numbers so a
disturbed run is recognisable.
"""

from __future__ import annotations

import os
import statistics
import threading
from pathlib import Path


class ForeignLoad:
    """Samples, twice a second, whether a runnable process outside this benchmark's process tree
    exists (Linux /proc only), and the 1-minute load average."""

    def __init__(self):
        self.samples = self.busy = 0
        self.seen: dict[str, int] = {}
        self.loadavg = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _stat(pid):
        text = Path(f"/proc/{pid}/stat").read_text()
        name_end = text.rindex(")")
        fields = text[name_end + 2:].split()
        return text[text.index("(") + 1:name_end], fields[0], int(fields[1])

    def _run(self):
        me = os.getpid()
        while not self._stop.wait(0.5):
            table = {}
            try:
                for entry in os.scandir("/proc"):
                    if entry.name.isdigit():
                        try:
                            table[int(entry.name)] = self._stat(entry.name)
                        except (OSError, ValueError):
                            pass
            except OSError:
                return
            foreign = []
            for pid, (name, state, _) in table.items():
                if state != "R" or pid == me:
                    continue
                ancestor = pid
                while ancestor in table and ancestor not in (me, 0, 1):
                    ancestor = table[ancestor][2]
                if ancestor != me:
                    foreign.append(name)
            self.samples += 1
            self.loadavg.append(os.getloadavg()[0])
            if foreign:
                self.busy += 1
                for name in set(foreign):
                    self.seen[name] = self.seen.get(name, 0) + 1

    def __enter__(self):
        if Path("/proc/self/stat").exists():
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def summary(self):
        return {"samples": self.samples,
                "busy_fraction": round(self.busy / self.samples, 3) if self.samples else None,
                "loadavg_median": round(statistics.median(self.loadavg), 2) if self.loadavg else None,
                "processes": dict(sorted(self.seen.items(), key=lambda kv: -kv[1])[:5])}
