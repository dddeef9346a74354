"""A forked child of a rank lets go of exactly its sync subgroup's gloo connections.

While a 2-rank subgroup is built, each rank's gloo constructor is followed, still inside the
window :meth:`SyncGroup.subgroup` watches, by opens of the kind another thread makes: a
``multiprocessing.Pipe``, a TCP connection to a local server (both ends) and a second client
of the group's store (rank 1 opens it; rank 0's store accepts it inside its own window, as
rank 0 waits for the key rank 1 writes through it). A child forked then finds every gloo
connection on ``/dev/null`` and every one of those other descriptors still on its socket.

Two subgroups over the same ranks built at the same time (two channels' threads) each record
only their own connections: dropping one (which shuts its connections down) leaves the
other's working.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_utils import links_in_child, wait_for_key
from sync_procs import spawn

import slipstream as ss
from slipstream.core.fork_closed import open_sockets
from slipstream.sync import group as group_module
from slipstream.sync.group import STORE_PREFIX

CLONED = "test/cloned"


def _connected(fd: int) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """``fd``'s (local, remote) endpoints when it is a connected TCP socket, else None."""
    with socket.socket(fileno=os.dup(fd)) as s:
        if s.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            return s.getsockname()[:2], s.getpeername()[:2]
        except OSError:
            return None  # a listener


def _new_since(before: dict[int, str]) -> list[int]:
    return [fd for fd, s in open_sockets().items() if before.get(fd) != s]


def _rank(rank: int, port: int) -> dict[str, list[str]]:
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    server = socket.create_server(("127.0.0.1", 0))
    held: list = []  # what the window opened, kept open until the child looked
    stores: list[dist.Store] = []
    fds: dict[str, list[int]] = {}

    class OpensMeanwhile(group_module._GLOO):
        def __init__(self, *args: object) -> None:
            before = open_sockets()
            super().__init__(*args)
            fds["gloo"] = [
                fd
                for fd in _new_since(before)
                if (ends := _connected(fd)) is not None and port not in (ends[0][1], ends[1][1])
            ]
            before = open_sockets()
            pipe = multiprocessing.Pipe()
            client = socket.create_connection(server.getsockname(), timeout=10)
            accepted = server.accept()[0]
            held.extend([*pipe, client, accepted])
            fds["pipe"] = [c.fileno() for c in pipe]
            fds["tcp"] = [client.fileno(), accepted.fileno()]
            if rank == 1:
                tcp = dist.TCPStore(
                    "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)
                )
                stores.append(tcp)
                dist.PrefixStore(STORE_PREFIX, tcp).set(CLONED, "1")
            else:
                wait_for_key(group.store, CLONED, 30, "rank 1's second store client")
            fds["store"] = [
                fd
                for fd in _new_since(before)
                if (ends := _connected(fd)) is not None and port in (ends[0][1], ends[1][1])
            ]

    group_module._GLOO = OpensMeanwhile
    group.subgroup([0, 1])
    names = list(fds)
    flat = [fd for name in names for fd in fds[name]]
    parent = [os.readlink(f"/proc/self/fd/{fd}") for fd in flat]
    child = links_in_child(flat)
    out: dict[str, list[str]] = {}
    for name in names:
        n = len(fds[name])
        out[name] = [f"{p} -> {c}" for p, c in zip(parent[:n], child[:n], strict=True)]
        parent, child = parent[n:], child[n:]
    group.close()
    for h in held:
        h.close()
    server.close()
    return out


def test_a_forked_child_lets_go_of_the_gloo_connections_and_keeps_what_other_threads_opened():
    out = spawn(_rank, 2, timeout=120)
    for rank, links in out.items():
        assert links["gloo"] and links["store"], (rank, links)
        for link in links["gloo"]:
            assert link.endswith(f"-> {os.devnull}"), (rank, links)
        for name in ("pipe", "tcp", "store"):
            for link in links[name]:
                before, after = link.split(" -> ")
                assert before.startswith("socket:") and after == before, (rank, name, links)


def _two_at_once(rank: int, port: int) -> list[float]:
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    both_started = threading.Barrier(2, timeout=30)

    class StartsWithTheOther(group_module._GLOO):
        """Connects only once the other group's device (its listener) exists too, so each
        group's window holds both groups' listeners and connections."""

        def __init__(self, *args: object) -> None:
            both_started.wait()
            super().__init__(*args)

    group_module._GLOO = StartsWithTheOther
    built: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda t=tag: built.update({t: group.subgroup([0, 1], t)}))
        for tag in ("one", "two")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    group.drop_subgroup([0, 1], "one")
    data = torch.arange(4, dtype=torch.float32) if rank == 0 else torch.zeros(4)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    built["two"].broadcast([data], opts).wait(timedelta(seconds=30))  # type: ignore[attr-defined]
    group.close()
    return data.tolist()


def test_two_subgroups_built_at_once_each_record_only_their_own_connections():
    out = spawn(_two_at_once, 2, timeout=120)
    assert out == {0: [0.0, 1.0, 2.0, 3.0], 1: [0.0, 1.0, 2.0, 3.0]}
