"""A forked child lets go of the sockets recorded in a :class:`ForkClosedSockets`: each is
pointed at ``/dev/null`` there (so the parent's death closes the connection), only while it
is still the socket recorded; a socket not recorded, or forgotten, stays in the child.
:func:`tcp_sockets` reads a TCP socket's endpoints as the socket itself gives them, and
:func:`group_connections` keeps only connections between two members' new sockets made on a
listener one of them opened then."""

from __future__ import annotations

import os
import socket
from contextlib import ExitStack

import pytest
from dist_utils import links_in_child

from slipstream.core.fork_closed import (
    ForkClosedSockets,
    NewSockets,
    TcpSocket,
    group_connections,
    open_sockets,
    tcp_sockets,
)


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
        links = links_in_child(fds)
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
        links = links_in_child([second[0].fileno()])
        assert links == [now], (links, now)
    finally:
        for s in second:
            s.close()


def _connected(stack: ExitStack, family: socket.AddressFamily, host: str) -> list:
    """A listener on ``host``, a client connected to it and the accepted end, all closed by
    ``stack``."""
    server = stack.enter_context(socket.create_server((host, 0), family=family))
    client = stack.enter_context(socket.socket(family))
    if family == socket.AF_INET6:
        client.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    client.settimeout(10)
    client.connect((host, server.getsockname()[1]))
    accepted = stack.enter_context(server.accept()[0])
    return [server, client, accepted]


def _ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


def test_tcp_sockets_gives_each_tcp_socket_s_own_endpoints_and_leaves_unix_sockets_out():
    with ExitStack() as stack:
        server, client, accepted = _connected(stack, socket.AF_INET, "127.0.0.1")
        pair = socket.socketpair()
        for s in pair:
            stack.enter_context(s)
        found = tcp_sockets(open_sockets())
        assert found[server.fileno()] == TcpSocket(server.getsockname(), ("0.0.0.0", 0), True)
        for s in (client, accepted):
            assert found[s.fileno()] == TcpSocket(s.getsockname(), s.getpeername(), False)
        assert pair[0].fileno() not in found and pair[1].fileno() not in found


def test_tcp_sockets_writes_an_ipv4_mapped_ipv6_endpoint_as_ipv4():
    with ExitStack() as stack:
        server = _connected(stack, socket.AF_INET, "127.0.0.1")[0]
        v6 = stack.enter_context(socket.socket(socket.AF_INET6))
        v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        v6.settimeout(10)
        v6.connect(("::ffff:127.0.0.1", server.getsockname()[1]))
        found = tcp_sockets(open_sockets())
        assert found[v6.fileno()] == TcpSocket(
            ("127.0.0.1", v6.getsockname()[1]), server.getsockname(), False
        )


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_tcp_sockets_reads_an_ipv6_endpoint():
    with ExitStack() as stack:
        server, client = _connected(stack, socket.AF_INET6, "::1")[:2]
        found = tcp_sockets(open_sockets())
        assert found[server.fileno()] == TcpSocket(
            ("::1", server.getsockname()[1]), ("::", 0), True
        )
        assert found[client.fileno()] == TcpSocket(
            client.getsockname()[:2], client.getpeername()[:2], False
        )


A_LISTENER = ("10.0.0.1", 5000)
A_STORE = ("10.0.0.1", 29500)
B_CLIENT = ("10.0.0.2", 40001)
B_STORE_CLIENT = ("10.0.0.2", 40002)
SERVER = ("10.0.0.9", 443)


def test_group_connections_keeps_a_connection_to_a_member_on_a_listener_new_to_either_end():
    a = {
        3: TcpSocket(("0.0.0.0", A_LISTENER[1]), ("0.0.0.0", 0), True),
        4: TcpSocket(A_LISTENER, B_CLIENT, False),  # accepted from B
        5: TcpSocket(A_STORE, B_STORE_CLIENT, False),  # the store's old listener took it
        6: TcpSocket(("10.0.0.1", 40003), SERVER, False),  # to a server, not a member
    }
    b = {
        7: TcpSocket(B_CLIENT, A_LISTENER, False),
        8: TcpSocket(B_STORE_CLIENT, A_STORE, False),
        9: TcpSocket(("10.0.0.2", 40004), SERVER, False),
    }
    posted_a = NewSockets.from_json(NewSockets.of(a.values()).to_json())
    posted_b = NewSockets.from_json(NewSockets.of(b.values()).to_json())
    assert posted_a == NewSockets.of(a.values())
    assert set(group_connections(a, posted_a, [posted_b])) == {4}
    assert set(group_connections(b, posted_b, [posted_a])) == {7}
    assert group_connections(b, posted_b, []) == {}


def test_group_connections_leave_out_another_groups_built_at_the_same_time():
    """Two groups between the same members built at once (two channels' threads): each
    member's window holds both groups' listeners and connections, and each group keeps only
    the connections made on its own listeners."""
    b_one, b_two = ("10.0.0.2", 40011), ("10.0.0.2", 40012)
    a_window = {
        3: TcpSocket(("0.0.0.0", 5001), ("0.0.0.0", 0), True),  # group one's listener
        4: TcpSocket(("0.0.0.0", 5002), ("0.0.0.0", 0), True),  # group two's listener
        5: TcpSocket(("10.0.0.1", 5001), b_one, False),  # group one's connection
        6: TcpSocket(("10.0.0.1", 5002), b_two, False),  # group two's connection
    }
    b_window = {
        7: TcpSocket(b_one, ("10.0.0.1", 5001), False),
        8: TcpSocket(b_two, ("10.0.0.1", 5002), False),
    }
    a_one = NewSockets.of([a_window[3], a_window[5], a_window[6]])
    b_posted = NewSockets.of(b_window.values())
    assert set(group_connections(a_window, a_one, [b_posted])) == {5}
    assert set(group_connections(b_window, b_posted, [a_one])) == {7}
