"""A wake-up call for ranks that wait idle outside MPI.

An idle spare learns of a recovery through MPI's revoke, but MPI moves nothing for a process
that is not inside it: testing every IDLE_POLL_S, the spare sees the revoke one or two tests
late, and the survivors wait for it in their shrink. A doorbell is a UDP socket the spare
sleeps on between its tests: the survivors send it one datagram as they revoke, and the spare
tests at once and then often until the revoke has reached it.

The datagram only hurries a test: what the spare acts on is still the revoke MPI delivers. A
datagram lost, or an address that does not reach the spare's host, costs the polling interval
the spare had without one, never a wrong step; a stray datagram (not this job's token) costs
a few quick tests.
"""

from __future__ import annotations

import os
import select
import socket
import sys

from hpcckpt.cluster.collectives import quiet_bcast

TOKEN_BYTES = 16
# An address no packet is sent to: connecting a UDP socket there only asks the kernel which
# interface routes off this host.
ROUTING_PROBE = ("10.255.255.255", 1)


def this_hosts_addresses() -> list[str]:
    """This host's IPv4 addresses other hosts may reach: the one that routes off it, and what
    its host name resolves to (loopback left out)."""
    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(ROUTING_PROBE)
        found.append(probe.getsockname()[0])
    except OSError:
        pass  # no route off this host: its name's addresses, or none
    finally:
        probe.close()
    try:
        found += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET,
                                                            socket.SOCK_DGRAM)]
    except OSError:
        pass  # a host name nothing resolves: the routed address, or none
    return [address for address in dict.fromkeys(found) if not address.startswith("127.")]


class Doorbell:
    """(all ranks of `comm`) Collective to construct: the ranks with `listening` true get a
    socket to wait on; every rank learns where to ring each of them, by its `key`."""

    def __init__(self, comm, listening: bool, key):
        self.token = quiet_bcast(comm, os.urandom(TOKEN_BYTES) if comm.Get_rank() == 0 else None, root=0)
        self._socket = None
        mine = None
        if listening:
            self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._socket.bind(("0.0.0.0", 0))
            self._socket.setblocking(False)
            mine = (key, socket.gethostname(), this_hosts_addresses(), self._socket.getsockname()[1])
        host = socket.gethostname()
        self._targets = {}
        for listener in comm.allgather(mine):
            if listener is None:
                continue
            their_key, their_host, addresses, port = listener
            self._targets[their_key] = [("127.0.0.1", port)] if their_host == host else [(a, port) for a in addresses]
        self._ring_failed = False

    def ring(self, keys) -> None:
        """Wake the listeners of `keys`; returns at once. A failed send is said once: the
        listeners then notice what they are woken for at their next test."""
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for target in (target for key in keys for target in self._targets.get(key, ())):
                try:
                    sender.sendto(self.token, target)
                except OSError as exc:
                    if not self._ring_failed:
                        self._ring_failed = True
                        print(f"hpcckpt: could not wake an idle spare at {target[0]}:{target[1]} ({exc}): it "
                              f"joins the recovery at its next test instead", file=sys.stderr, flush=True)
        finally:
            sender.close()

    def wait(self, timeout_s: float) -> bool:
        """(a listener) Sleep until rung or `timeout_s` has passed; True if rung."""
        readable, _, _ = select.select([self._socket], [], [], timeout_s)
        rung = False
        while readable:
            try:
                rung |= self._socket.recv(TOKEN_BYTES + 1) == self.token
            except BlockingIOError:
                break
        return rung

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
