"""Safe types a user extends: ``ss.allow_types`` and the well-known configuration classes.

A Lightning-style checkpoint dict whose hyper-parameters hold a dataclass, an Enum and an
omegaconf config loads without ``trusted=True`` once the user's two classes are allowed;
the reference is ``torch.load`` of the same dict (which unpickles anything). Hostile
payloads, alone or hidden inside allowed containers, still never run.
"""

from __future__ import annotations

import dataclasses
import enum
import os

import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import slipstream as ss


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


@dataclasses.dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    mode: Mode = Mode.TRAIN


class _TouchesFile:
    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _lightning_checkpoint() -> dict:
    """The shape of what Lightning's ``dump_checkpoint`` returns for a module that called
    ``save_hyperparameters`` with a config object, a dataclass and an Enum."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    config = OmegaConf.create({"model": {"width": 64, "layers": [1, 2]}, "seed": 7, "x": "${seed}"})
    return {
        "epoch": 1,
        "global_step": 10,
        "pytorch-lightning_version": "2.5.0",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None}},
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": {
            "config": config,
            "optim": OptimConfig(),
            "mode": Mode.EVAL,
            "sizes": ListConfig([1, 2, 3]),
            "history": (config, OptimConfig(lr=1.0, mode=Mode.EVAL)),
        },
        "hparams_type": DictConfig,
    }


def _same(got, want) -> bool:
    """Equal values of the same types; a config compared with its interpolations resolved
    (a mapping is saved by its entries, which resolve them)."""
    if isinstance(want, torch.Tensor):
        return torch.equal(got, want)
    if isinstance(want, (DictConfig, ListConfig)):
        return type(got) is type(want) and OmegaConf.to_container(
            got, resolve=True
        ) == OmegaConf.to_container(want, resolve=True)
    if isinstance(want, dict):
        return (
            type(got) is type(want)
            and list(got) == list(want)
            and all(_same(got[k], want[k]) for k in want)
        )
    if isinstance(want, (list, tuple)):
        return (
            type(got) is type(want)
            and len(got) == len(want)
            and all(_same(g, w) for g, w in zip(got, want, strict=True))
        )
    return type(got) is type(want) and got == want


def test_lightning_style_checkpoint_loads_with_allowed_types_and_no_trust(tmp_path):
    state = _lightning_checkpoint()
    ss.save(state, tmp_path / "ck")
    # The reference: the state after a torch.save/torch.load round trip, which unpickles
    # anything. As in DCP, a mapping (a DictConfig too) is saved by its entries and a
    # sequence (a ListConfig) as one value; DCP's own reading gives every mapping back a
    # dict, where load_all rebuilds its recorded type (and its empty ones).
    torch.save(state, tmp_path / "ref.pt")
    want = torch.load(tmp_path / "ref.pt", weights_only=False)
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "dcp.pt")
    by_dcp = torch.load(tmp_path / "dcp.pt", weights_only=False)
    assert type(by_dcp["hyper_parameters"]["config"]) is dict
    assert isinstance(by_dcp["hyper_parameters"]["sizes"], ListConfig)
    assert isinstance(by_dcp["hyper_parameters"]["history"][0], DictConfig)

    with pytest.raises(ss.UnsafeCheckpointError) as refused:
        ss.load_all(tmp_path / "ck")
    message = str(refused.value)
    assert f"{__name__}.OptimConfig" in message or f"{__name__}.Mode" in message
    assert "omegaconf" not in message, "omegaconf's containers are allowed by default"

    with ss.allow_types(OptimConfig, f"{__name__}.Mode"):
        got = ss.load_all(tmp_path / "ck")
    assert _same(got, want)
    assert got["hyper_parameters"]["mode"] is Mode.EVAL
    assert list(got["optimizer_states"][0]["state"]) == [0, 1]
    assert got["hyper_parameters"]["history"][0].x == 7, "interpolations still resolve"
    assert type(got["hyper_parameters"]["config"]) is DictConfig
    assert got["loops"]["fit_loop"]["state_dict"] == {}
    assert got["hparams_type"] is DictConfig

    with pytest.raises(ss.UnsafeCheckpointError):  # revoked on leaving the block
        ss.load_all(tmp_path / "ck")


def test_load_into_a_template_uses_the_allowed_types(tmp_path):
    ss.save({"optim": OptimConfig(lr=0.5)}, tmp_path / "ck")
    allowance = ss.allow_types(OptimConfig, Mode)
    try:
        target = {"optim": None}
        ss.load(target, tmp_path / "ck")
        assert target["optim"] == OptimConfig(lr=0.5)
    finally:
        allowance.revoke()


@pytest.mark.parametrize(
    "payload",
    [
        lambda m: OmegaConf.create({"a": 1}),
        lambda m: OptimConfig(lr=_TouchesFile(m)),
    ],
    ids=["in_dictconfig", "in_allowed_dataclass"],
)
def test_hostile_pickle_inside_allowed_types_never_runs(tmp_path, payload):
    marker = tmp_path / "ran"
    value = payload(marker)
    if isinstance(value, DictConfig):  # smuggle it past omegaconf's own validation
        value._content["a"].__dict__["_val"] = _TouchesFile(marker)
    ss.save({"v": (value,)}, tmp_path / "ck")  # in a tuple: one pickled value, whole
    assert not marker.exists()
    with ss.allow_types(OptimConfig, Mode):
        with pytest.raises(ss.UnsafeCheckpointError, match=r"(posix|os)\.system"):
            ss.load_all(tmp_path / "ck")
    assert not marker.exists()


class _CallsEnumFunctionalApi:
    """Pickles as ``Mode("Extended", "A B")``: the Enum functional API's call."""

    def __reduce__(self):
        return (Mode, ("Extended", "A B"))


def test_allowed_enum_is_only_looked_up_never_extended(tmp_path):
    ss.save({"v": _CallsEnumFunctionalApi()}, tmp_path / "ck")
    with ss.allow_types(Mode), pytest.raises(ss.CheckpointError, match="value 'v'"):
        ss.load({"v": None}, tmp_path / "ck")
    assert Mode.__subclasses__() == []


def test_allow_types_rejects_what_is_not_a_class_or_name():
    with pytest.raises(TypeError):
        ss.allow_types(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no_such_module.Thing"):
        ss.allow_types("no_such_module.Thing")
