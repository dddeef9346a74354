import torch

from slipstream.core.flatten import is_stateful, resolve_stateful


class Counter:
    def __init__(self) -> None:
        self.n = 3

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


class StatefulDict(dict):
    def state_dict(self) -> dict:
        return {"inner": dict(self)}

    def load_state_dict(self, sd: dict) -> None:
        self.update(sd["inner"])


def test_plain_values_and_tensors_are_not_stateful():
    for value in (torch.zeros(2), torch.nn.Parameter(torch.zeros(2)), {}, [], (), 1, 1.5, "s"):
        assert not is_stateful(value)


def test_stateful_objects_are_found_even_when_they_subclass_a_container():
    assert is_stateful(Counter())
    assert is_stateful(StatefulDict(a=1))
    resolved = resolve_stateful({"c": Counter(), "d": StatefulDict(a=1), "t": torch.ones(1)})
    assert resolved["c"] == {"n": 3}
    assert resolved["d"] == {"inner": {"a": 1}}
    assert torch.equal(resolved["t"], torch.ones(1))
