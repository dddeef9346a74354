"""A forked child lets go of the sockets recorded in a :class:`ForkClosedSockets`: each is
pointed at ``/dev/null`` there (so the parent's death closes the connection), only while it
is still the socket recorded; a socket not recorded, or forgotten, stays in the child."""

from __future__ import annotations

import os
import socket

from slipstream.core.fork_closed import ForkClosedSockets, open_sockets


def _in_child(fds: list[int]) -> list[str]:
    """What each of ``fds`` names in a forked child (its links, one per line)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        links = []
        for fd in fds:
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                links.append("closed")
        os.write(write, "\n".join(links).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read().split("\n")
    os.waitpid(pid, 0)
    return out


def test_a_forked_child_points_recorded_sockets_at_dev_null_and_keeps_the_rest():
    registry = ForkClosedSockets()
    recorded, forgotten, other = socket.socketpair(), socket.socketpair(), socket.socketpair()
    try:
        before = open_sockets()
        assert recorded[0].fileno() in before
        registry.add("recorded", {recorded[0].fileno(): before[recorded[0].fileno()]})
        registry.add("forgotten", {forgotten[0].fileno(): before[forgotten[0].fileno()]})
        registry.discard("forgotten")
        fds = [recorded[0].fileno(), forgotten[0].fileno(), other[0].fileno()]
        links = _in_child(fds)
        assert links[0] == os.devnull, links
        assert links[1].startswith("socket:") and links[2].startswith("socket:"), links
        # the parent keeps every socket as it was
        assert [os.readlink(f"/proc/self/fd/{fd}") for fd in fds] == [before[fd] for fd in fds]
    finally:
        for pair in (recorded, forgotten, other):
            for s in pair:
                s.close()


def test_a_descriptor_that_names_another_socket_now_is_left_alone():
    registry = ForkClosedSockets()
    first = socket.socketpair()
    fd = first[0].fileno()
    link = open_sockets()[fd]
    registry.add("stale", {fd: link})
    first[0].close()
    first[1].close()
    second = socket.socketpair()  # likely takes the same descriptor number
    try:
        now = os.readlink(f"/proc/self/fd/{second[0].fileno()}")
        links = _in_child([second[0].fileno()])
        assert links == [now], (links, now)
    finally:
        for s in second:
            s.close()
