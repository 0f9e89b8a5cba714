"""The doorbell idle spares sleep on (cluster/doorbell.py), on a real MPI communicator of one
rank: rung, a listener wakes long before its timeout; a datagram that is not the job's token
does not count as a ring; a listener nobody rings sleeps its whole timeout."""

import socket
import time

from mpi4py import MPI

from hpcckpt.cluster.doorbell import Doorbell, this_hosts_addresses


def test_a_ring_wakes_the_listener_and_a_stray_datagram_does_not():
    bell = Doorbell(MPI.COMM_SELF, listening=True, key=7)
    try:
        began = time.monotonic()
        assert not bell.wait(0.2)  # nobody rang
        assert time.monotonic() - began >= 0.19
        bell.ring([7])
        assert bell.wait(30.0)
        bell.ring([8])  # no listener has that key: nothing is sent
        assert not bell.wait(0.05)
        port = bell._socket.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stray:
            stray.sendto(b"not the token", ("127.0.0.1", port))
        assert not bell.wait(30.0)  # woken by the stray datagram, but it is not a ring
        bell.ring([7])
        bell.ring([7])
        assert bell.wait(30.0)
        assert not bell.wait(0.05)  # both rings were taken by the one wake-up
    finally:
        bell.close()


def test_a_rank_that_does_not_listen_has_nothing_to_wait_on_but_can_ring():
    bell = Doorbell(MPI.COMM_SELF, listening=False, key=0)
    bell.ring([0])  # no listener: returns at once
    assert bell._socket is None


def test_a_listener_that_stopped_listening_sleeps_out_its_timeout_and_drains_nothing():
    bell = Doorbell(MPI.COMM_SELF, listening=True, key=3)
    bell.close()  # as a spare that took a place
    bell.ring([3])  # its old address: the datagram goes nowhere
    began = time.monotonic()
    assert not bell.wait(0.1)
    assert time.monotonic() - began >= 0.09
    assert not bell.drain()


def test_rings_queued_after_a_wake_up_are_drained_without_counting_as_a_new_one():
    bell = Doorbell(MPI.COMM_SELF, listening=True, key=5)
    try:
        bell.ring([5])
        assert bell.wait(30.0)
        bell.ring([5])  # another worker's ring of the same recovery, arriving late
        time.sleep(0.05)
        assert bell.drain()  # taken: the next wait sleeps
        assert not bell.wait(0.05)
    finally:
        bell.close()


def test_the_addresses_given_to_other_hosts_leave_out_loopback():
    assert all(not address.startswith("127.") for address in this_hosts_addresses())
