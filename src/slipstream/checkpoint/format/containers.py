"""The mapping types ``load_all`` rebuilds from what a save recorded of them.

A save records, beside the leaves, each mapping that is empty or not a plain ``dict``, as
its path and its type's name (:data:`~slipstream.core.flatten.Containers`). Invariant: a
name is only looked up in :data:`REBUILDERS`, a fixed table of types that hold their
entries as plain data; a record never names code that loading would run, and a name not
in the table (or whose package is not installed) comes back as a plain ``dict``. Each
rebuilder takes the loaded entries, in their saved order, already rebuilt themselves.
"""

from __future__ import annotations

import collections
import importlib
from collections.abc import Callable
from typing import Any

Rebuilder = Callable[[dict[Any, Any]], Any]


def _omegaconf_dict(content: dict[Any, Any]) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(content)


def _attribute_dict(module: str) -> Rebuilder:
    def rebuild(content: dict[Any, Any]) -> Any:
        return importlib.import_module(module).AttributeDict(content)

    return rebuild


REBUILDERS: dict[str, Rebuilder] = {
    "builtins.dict": dict,
    "collections.OrderedDict": collections.OrderedDict,
    "omegaconf.dictconfig.DictConfig": _omegaconf_dict,
    "lightning.fabric.utilities.data.AttributeDict": _attribute_dict(
        "lightning.fabric.utilities.data"
    ),
    "lightning.pytorch.utilities.parsing.AttributeDict": _attribute_dict(
        "lightning.pytorch.utilities.parsing"
    ),
    "pytorch_lightning.utilities.parsing.AttributeDict": _attribute_dict(
        "pytorch_lightning.utilities.parsing"
    ),
}


def rebuild(name: str, content: dict[Any, Any]) -> Any:
    """``content`` as the mapping type ``name``, if :data:`REBUILDERS` has it and its
    package is installed; ``content`` itself otherwise."""
    rebuilder = REBUILDERS.get(name)
    if rebuilder is None:
        return content
    try:
        return rebuilder(content)
    except ImportError:
        return content
