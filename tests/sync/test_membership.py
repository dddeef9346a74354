"""Who a member is, and when its process is gone (:mod:`slipstream.sync.group`).

A member's process is judged by its pid only from the same kernel and PID namespace
(:func:`host_identity` tells them apart: a process in a PID namespace of its own has another
identity, so it is judged by its heartbeat), and a pid reused by a later process does not
keep a dead member alive (its start time differs).
"""

from __future__ import annotations

import os
import subprocess
import sys

from netns_cluster import require_namespaces

from slipstream.sync.group import Member, host_identity, process_start


def test_a_member_whose_pid_now_names_a_later_process_is_gone():
    me = os.getpid()
    start = process_start(me)
    assert start is not None
    assert Member(host_identity(), me, 1, start).gone() is None
    why = Member(host_identity(), me, 1, start - 1).gone()
    assert why is not None and f"pid {me}" in why


def test_a_member_whose_process_exited_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start(child.pid)
    child.wait()
    assert Member(host_identity(), child.pid, 1, start).gone() is not None


def test_a_process_in_a_pid_namespace_of_its_own_has_another_host_identity():
    require_namespaces()
    code = "from slipstream.sync.group import host_identity; print(host_identity())"
    out = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    theirs = out.stdout.strip()
    assert theirs and theirs != host_identity()
    # same machine: the hostname and boot id agree, the PID namespace does not
    assert theirs.split("/")[:2] == host_identity().split("/")[:2]
