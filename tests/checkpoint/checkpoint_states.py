"""State dicts the checkpoint tests save, and how they compare what comes back.

Shared by every folder of tests/checkpoint/ (it is on the path of all of them, see
tests/conftest.py): the small states most tests save (:func:`step_state`, :func:`small_state`),
the DTensor and plain states of the resharding tests, the state holding every kind of value,
and the comparisons and blank copies that loads fill in."""

from __future__ import annotations

import random

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def step_state(step: int, shape: tuple[int, ...] = (1000,), **extra) -> dict:
    """``{"w": a float32 tensor of ``shape`` whose every element is ``step``, "step": step}``,
    plus ``extra`` beside them: what a checkpoint of this state holds says which step saved
    it, and the same arguments build equal tensors (so a test compares with a fresh copy)."""
    return {"w": torch.full(shape, float(step)), "step": step, **extra}


def small_state(
    step: int = 3, *, seed: int | None = None, shape: tuple[int, int] = (96, 64), **extra
) -> dict:
    """A model of two tensors and the step that saved it, plus ``extra`` beside them:
    ``{"model": {"w": normal values of ``shape`` drawn from ``seed``, "b": 0..6 + step},
    "step": step}``. ``seed`` defaults to ``step``, so states of different steps differ in
    every tensor; the same arguments build equal tensors, from a generator of their own (the
    global random state is left alone)."""
    g = torch.Generator().manual_seed(step if seed is None else seed)
    model = {"w": torch.randn(shape, generator=g), "b": torch.arange(7.0) + step}
    return {"model": model, "step": step, **extra}


# name -> (shape, dtype, placement kind); shard sizes are uneven on purpose, and "tiny"
# leaves rank 3 of 4 with an empty shard.
TENSORS = {
    "rows": ((10, 6), torch.float32, "shard0"),
    "cols": ((4, 10), torch.float64, "shard1"),
    "half": ((9, 4), torch.bfloat16, "shard0"),
    "tiny": ((3, 2), torch.int64, "shard0"),
    "rep": ((5, 3), torch.float32, "replicate"),
}


# Plain (non-DTensor) tensors every rank holds: written once each, by different ranks.
PLAIN = {f"plain{i}": (64, 64) for i in range(4)}


def full_tensor(name: str) -> torch.Tensor:
    if name in PLAIN:
        return torch.arange(64 * 64, dtype=torch.float32).reshape(PLAIN[name]) + int(name[-1])
    shape, dtype, _ = TENSORS[name]
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 1.5 + len(name)).to(dtype)


def expected_local(name: str, world: int, rank: int) -> torch.Tensor:
    """The part of the full tensor ``rank`` of ``world`` holds (DTensor's chunking)."""
    full = full_tensor(name)
    if name in PLAIN or world == 1 or TENSORS[name][2] == "replicate":
        return full
    dim = 0 if TENSORS[name][2] == "shard0" else 1
    pieces = torch.chunk(full, world, dim=dim)
    if rank < len(pieces):
        return pieces[rank]
    empty = list(full.shape)
    empty[dim] = 0
    return full.new_empty(empty)


def _placement(name: str):
    kind = TENSORS[name][2]
    return {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[kind]


def dtensor_state(mesh, fill: float | None = None) -> dict:
    """The test state as DTensors on ``mesh`` (or filled with ``fill`` to load into)."""
    state: dict = {"model": {}, "step": 0 if fill is not None else 42}
    for name in TENSORS:
        full = full_tensor(name)
        if fill is not None:
            full = torch.full_like(full, fill)
        state["model"][name] = distribute_tensor(full, mesh, [_placement(name)])
    for name in PLAIN:
        full = full_tensor(name)
        state["model"][name] = torch.full_like(full, fill) if fill is not None else full
    return state


def plain_state(fill: float | None = None) -> dict:
    """The test state as full plain tensors (what one rank without a mesh holds)."""
    state: dict = {"model": {}, "step": 0 if fill is not None else 42}
    for name in [*TENSORS, *PLAIN]:
        full = full_tensor(name)
        state["model"][name] = torch.full_like(full, fill) if fill is not None else full
    return state


def local_parts(state: dict) -> dict:
    """name -> the local tensor a rank holds, plus the loaded step."""
    out = {"step": state["step"]}
    for name, value in state["model"].items():
        local = value.to_local() if hasattr(value, "to_local") else value
        out[name] = local.detach().clone()
    return out


DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        parts = torch.randn((2, *shape), generator=g, dtype=torch.float64).mul(100)
        return torch.complex(parts[0], parts[1]).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).mul(100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def copy_state(state: dict) -> dict:
    """A copy of a flat state: its tensors cloned, its dicts copied, other values as they are
    (what a save must write, whatever happens to ``state`` after the call)."""
    return {
        k: (v.clone() if torch.is_tensor(v) else dict(v) if isinstance(v, dict) else v)
        for k, v in state.items()
    }


def blank_like(value):
    """A state dict of the same structure whose tensors and values hold something else."""
    if isinstance(value, dict):
        return {k: blank_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [blank_like(v) for v in value]
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool:
            return ~value.clone()
        return torch.zeros_like(value) + 1 if value.numel() else torch.empty_like(value)
    return None


def assert_same(got, want, where: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}.{i}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    else:
        assert type(got) is type(want) and got == want, where


def mixed_state() -> dict:
    base = random_tensor(torch.float32, (6, 10), 1)
    rng = random.Random(3)
    return {
        "dtypes": {
            str(d).removeprefix("torch."): random_tensor(d, (5, 7), i) for i, d in enumerate(DTYPES)
        },
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "int_scalar": torch.tensor(7),
        "empty": torch.empty(0, 4),
        "empty_int": torch.empty(3, 0, dtype=torch.int32),
        "transposed": base.t(),
        "strided_slice": base[1::2, 3:9:2],
        "rng": torch.get_rng_state(),
        "nested": {
            "list_of_tensors": [torch.arange(5), torch.ones(2, 2)],
            "mixed_list": [3, torch.full((2,), 4.0), "x"],
            "deep": {"a": {"b": torch.linspace(0, 1, 9)}},
        },
        "int": 12,
        "neg_float": -0.125,
        "string": "héllo",
        "bytes": b"\x00\xffraw",
        "none": None,
        "flag": True,
        "int_list": [1, 2, 3],
        "py_random_state": rng.getstate(),
        "tuple": (1, "two", 3.0),
    }
