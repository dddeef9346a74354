"""Several hosts sharing one file system, emulated on one machine (read_once.py's third case).

A shared file system's case is replicas on several hosts, each with its own page cache, all
reading through one storage backend's bandwidth. One machine's processes share its page cache,
so here the file system is an ext4 image file on the local disk, and each "host" (a rank
process) mounts it read-only through a loop device of its own with direct I/O
(``losetup --direct-io=on``), in a mount namespace of its own, at the same path as every other
host (as hosts mount a shared file system at one path). Each mount is its own superblock with
its own page cache; the loop device's direct I/O keeps the image's pages out of the machine's
cache, so every host's cold read goes to the one disk.

Needs root (loop devices, mounts, ``unshare(CLONE_NEWNS)``) and util-linux's ``losetup``,
``mount`` and ``umount``; ``mkfs.ext4`` from e2fsprogs.

- ``make_image``: the image file, an empty ext4 file system;
- ``writable``: the image mounted read-write (in the caller's namespace) to save into;
- ``host``: one host's mount, in the calling process: namespace, loop device, mount;
- ``released``: on the way out, every loop device of the image detached, whatever happened to
  the processes that attached them (a rank killed before its own teardown included).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from common import drop_page_cache

CLONE_NEWNS = 0x00020000
MIB = 1 << 20


def image_bytes(checkpoint_bytes: int) -> int:
    """The image's size for a checkpoint of ``checkpoint_bytes``: 20% over it and 64 MiB more
    (ext4's metadata and journal, the checkpoint's own metadata files)."""
    return (checkpoint_bytes * 6 // 5 + 64 * MIB) // MIB * MIB


def sh(*cmd: str) -> str:
    """Run ``cmd``; its stdout, stripped. On failure an error naming the command and its
    stderr (what the kernel refused, in losetup's or mount's words)."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip()


def make_image(image: Path, size: int) -> None:
    """An empty ext4 file system in the file ``image`` of ``size`` bytes. Its inode tables
    and journal are written now (not by ext4's lazy init in the background once mounted)."""
    image.unlink(missing_ok=True)
    sh("truncate", "-s", str(size), str(image))
    sh("mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(image))


def attached(image: Path) -> list[str]:
    """The loop devices backed by ``image`` now, or by a file of its path since deleted (a
    run killed outright before its clean-up, its scratch directory removed by the next)."""
    path = os.path.abspath(image)
    devices = []
    for line in sh("losetup", "-l", "-n", "-O", "NAME,BACK-FILE").splitlines():
        name, _, backing = line.strip().partition(" ")
        if backing.strip() in (path, f"{path} (deleted)"):
            devices.append(name)
    return devices


def detach(device: str) -> None:
    """``losetup -d``; on a device still mounted somewhere the kernel detaches it when the
    last mount goes (the device is marked autoclear)."""
    sh("losetup", "-d", device)


def detach_all(image: Path) -> list[str]:
    """Every loop device of ``image`` detached; the errors of those that would not be."""
    errors = []
    for device in attached(image):
        try:
            detach(device)
        except RuntimeError as e:
            errors.append(str(e))
    return errors


@contextlib.contextmanager
def writable(image: Path, mountpoint: Path) -> Iterator[Path]:
    """``image`` mounted read-write at ``mountpoint`` (made if missing) in this process's
    mount namespace, unmounted and its loop device detached on the way out. The image's
    pages the writes left in the page cache are evicted then, so no host reads them."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    device = sh("losetup", "-f", "--show", str(image))
    try:
        sh("mount", device, str(mountpoint))
        try:
            yield mountpoint
        finally:
            sh("umount", str(mountpoint))
    finally:
        detach(device)
    drop_page_cache([image])


def enter_mount_namespace() -> None:
    """This process into a mount namespace of its own, its mounts private (none propagates
    to the machine's namespace or from it).

    ``unshare`` moves the calling thread only: threads started before it stay in the old
    namespace (torch's import starts one), the ones it starts afterwards come along. So this
    runs first in a rank, before any thread that reads files is started; a reader left behind
    would find the mount point empty and fail its load, not read somewhere else."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWNS): {os.strerror(errno)}")
    sh("mount", "--make-rprivate", "/")


@contextlib.contextmanager
def host(image: Path, mountpoint: Path) -> Iterator[str]:
    """One host's mount of the shared file system, in the calling process (which stays in
    the mount namespace it enters): ``image`` read-only through a direct-I/O loop device of
    its own at ``mountpoint``. Yields the device; unmounted and detached on the way out."""
    enter_mount_namespace()
    device = sh("losetup", "-f", "--show", "--direct-io=on", "-r", str(image))
    try:
        dio = sh("losetup", "-n", "-O", "DIO", device)
        if dio != "1":
            raise RuntimeError(f"{device}: direct I/O not on (losetup says DIO={dio!r})")
        sh("mount", "-o", "ro,noload", device, str(mountpoint))
        try:
            yield device
        finally:
            sh("umount", str(mountpoint))
    finally:
        detach(device)


@contextlib.contextmanager
def released(image: Path) -> Iterator[None]:
    """Every loop device backed by ``image`` detached on the way in (what a run killed
    outright left) and on the way out, then an error if any is still attached. A rank killed
    before its own teardown leaves its device attached (its mount goes with its namespace
    when its last process exits): this detaches it."""
    detach_all(image)
    try:
        yield
    finally:
        errors = detach_all(image)
        deadline = time.monotonic() + 10  # one detached while mounted goes with its mount
        while (left := attached(image)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left or errors:
            raise RuntimeError(f"loop devices of {image} still attached: {left} {errors}")
