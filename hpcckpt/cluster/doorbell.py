"""A wake-up call for ranks that wait idle outside MPI.

An idle spare learns of a recovery through MPI's revoke, but MPI moves nothing for a process
that is not inside it: testing every IDLE_POLL_S, the spare sees the revoke one or two tests
late, and the survivors wait for it in their shrink. A doorbell is a UDP socket the spare
sleeps on between its tests: the survivors send it one datagram as they revoke, and the spare
tests at once and then often until the revoke has reached it.

The datagram only hurries a test: what the spare acts on is still the revoke MPI delivers. A
datagram lost, an address that does not reach the spare's host, or a doorbell that could not
be set up (said once) costs the polling interval the spare had without one, never a wrong
step; a stray datagram (not this job's token) costs a few quick tests. The socket listens on
an ephemeral port of every interface and takes only datagrams that carry the job's token.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time

from hpcckpt.cluster.collectives import quiet_allgather, quiet_bcast

TOKEN_BYTES = 16
# An address no packet is sent to: connecting a UDP socket there only asks the kernel which
# interface routes off this host.
ROUTING_PROBE = ("10.255.255.255", 1)


def this_hosts_addresses() -> list[str]:
    """This host's IPv4 addresses other hosts may reach: the one that routes off it, or else
    what its host name resolves to (loopback left out). The name is resolved only without a
    route, since a resolver that does not answer stalls start-up for its timeouts."""
    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(ROUTING_PROBE)
        found.append(probe.getsockname()[0])
    except OSError:
        try:
            found += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET,
                                                                socket.SOCK_DGRAM)]
        except OSError:
            pass  # neither a route nor a resolvable name: the caller says so where it matters
    finally:
        probe.close()
    return [address for address in dict.fromkeys(found) if not address.startswith("127.")]


class Doorbell:
    """(all ranks of `comm`) Collective to construct: the ranks with `listening` true get a
    socket to wait on; every rank learns where to ring each of them, by its `key`."""

    def __init__(self, comm, listening: bool, key):
        self.token = quiet_bcast(comm, os.urandom(TOKEN_BYTES) if comm.Get_rank() == 0 else None, root=0)
        self._rank = comm.Get_rank()
        self._said: set = set()
        self._socket = None
        self._sender = None
        host = socket.gethostname()
        mine = None
        if listening:
            try:
                self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                self._socket.bind(("0.0.0.0", 0))
                self._socket.setblocking(False)
                mine = (key, this_hosts_addresses(), self._socket.getsockname()[1])
            except OSError as exc:
                self.close()
                self._say("set-up", f"no doorbell on this spare ({exc})")
        try:
            self._sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sender.setblocking(False)  # a full send buffer loses a ring, never blocks a recovery
        except OSError as exc:
            self._sender = None
            self._say("sender", f"cannot ring the idle spares' doorbells ({exc})")
        self._targets = {}
        everyone = quiet_allgather(comm, (host, mine))
        for their_host, listener in everyone:
            if listener is not None:
                their_key, addresses, port = listener
                self._targets[their_key] = [("127.0.0.1", port)] if their_host == host else \
                    [(address, port) for address in addresses]
        if mine is not None and not mine[1] and any(other != host for other, _ in everyone):
            self._say("address", "this host has no IPv4 address other hosts can reach: its doorbell rings only "
                                 "from ranks on this host")

    def _say(self, what, problem: str) -> None:
        """Once per kind of problem: each only slows a spare's wake-up to its polling interval."""
        if what not in self._said:
            self._said.add(what)
            print(f"hpcckpt: rank {self._rank}: {problem}; an idle spare then notices a recovery or its release at "
                  f"its next test instead", file=sys.stderr, flush=True)

    def ring(self, keys) -> None:
        """Wake the listeners of `keys`; returns at once (a datagram that cannot go at once is
        lost, said once per address)."""
        if self._sender is None:
            return
        for target in (target for key in keys for target in self._targets.get(key, ())):
            try:
                self._sender.sendto(self.token, target)
            except OSError as exc:
                self._say(target, f"could not ring the doorbell at {target[0]}:{target[1]} ({exc})")

    def wait(self, timeout_s: float) -> bool:
        """(a listener) Sleep until rung or `timeout_s` has passed; True if rung."""
        if self._socket is None:
            time.sleep(timeout_s)
            return False
        try:
            poller = select.poll()  # not select(): it refuses descriptors past 1023
            poller.register(self._socket, select.POLLIN)
            return bool(poller.poll(timeout_s * 1000)) and self.drain()
        except OSError as exc:
            self.close()
            self._say("wait", f"the doorbell failed ({exc})")
            return False

    def drain(self) -> bool:
        """(a listener) Take every datagram waiting; True if one was this job's ring."""
        rung = False
        while self._socket is not None:
            try:
                rung |= self._socket.recv(TOKEN_BYTES + 1) == self.token
            except BlockingIOError:
                break
        return rung

    def close(self) -> None:
        """Stop listening (a spare that took a place); ringing others still works."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
