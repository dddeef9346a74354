"""An in-process stand-in for the part of a :class:`~slipstream.sync.group.SyncGroup` a
round uses when it is given up, on a :class:`Board` that logs what happens in order; a
trainer's :class:`Sender` that sends nothing, and :func:`fail`, a round's step that
raises."""

from __future__ import annotations

from typing import Any


class Board:
    """The store the round's ranks share, and the order things happened in. A key in
    ``hidden`` is not seen by the next ``has`` asking for it (it was posted just after that
    look)."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}
        self.log: list[str] = []
        self.hidden: set[str] = set()


class Group:
    """One rank's view of a :class:`Board`; no rank is ever found dead by liveness."""

    def __init__(self, rank: int, board: Board) -> None:
        self.rank = rank
        self.board = board

    def post_first(self, key: str, text: str) -> bytes:
        if key not in self.board.keys:
            self.board.keys[key] = text
            self.board.log.append(f"{key} posted by {self.rank}")
        return self.board.keys[key].encode()

    def post(self, key: str, text: str) -> None:
        self.board.keys[key] = text
        self.board.log.append(f"{key} posted by {self.rank}")

    def has(self, key: str) -> bool:
        if key in self.board.hidden:
            self.board.hidden.discard(key)
            return False
        return key in self.board.keys

    def get_text(self, key: str, rank: int, what: str, timeout: float | None = None) -> str:
        return self.board.keys[key]

    def read(self, key: str) -> bytes:
        return self.board.keys[key].encode()

    def append(self, key: str, text: str) -> None:
        self.board.keys[key] = self.board.keys.get(key, "") + text

    def wait_keys(self, keys: dict[int, str], what: str, *args: Any, **kwargs: Any) -> dict:
        missing = sorted(r for r, k in keys.items() if k not in self.board.keys)
        assert not missing, f"ranks {missing} never posted {what}"
        return {}

    def dead(self, ranks: list[int]) -> dict[int, str]:
        return {}

    def drop_subgroup(self, ranks: list[int], tag: str = "", broken: bool = False) -> None:
        self.board.log.append(f"transport of {self.rank} cut")


class Sender:
    """A trainer's transport with nothing in flight."""

    bytes_sent = 0

    def close(self) -> None:
        pass


def fail(error: BaseException):
    """A step of a round that raises ``error``."""

    def step() -> None:
        raise error

    return step
