"""Lightning's checkpoint state as JSON plus a list of tensors, without pickling anything.

JSON has no tuples, no dict keys other than strings, no tensors; Lightning's loop, scheduler and
callback states use all three. They become tagged objects (``{"$sparselift": "tuple", ...}``;
tensors by index into the list, which is saved with ``torch.save`` and read back weights-only),
so they come back exactly; subclasses (Lightning's ``AttributeDict``, an ``IntEnum``) come back
as their base type. Anything else (an arbitrary object) would need pickling, and unpickling can
run code: its dict entry is left out and named (raising instead would make a model whose
hyper-parameters hold, say, a function impossible to checkpoint at all).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

_TAG = "$sparselift"


class _Unencodable(Exception):
    pass


class StateEncoder:
    """JSON for Lightning's state: tuples, dicts with keys JSON cannot hold and tensors become
    tagged objects (tensors go to ``tensors``); a dict entry holding anything else is left out
    and named in ``dropped``."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.dropped: list[str] = []

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, Tensor):
            self.tensors.append(value.detach().cpu())
            return {_TAG: "tensor", "index": len(self.tensors) - 1}
        if isinstance(value, tuple):
            return {_TAG: "tuple", "items": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            return self._encode_dict(value, where)
        raise _Unencodable(f"{where} ({type(value).__qualname__})")

    def _encode_dict(self, value: dict[Any, Any], where: str) -> Any:
        items = []
        for key, item in value.items():
            kept_tensors = len(self.tensors)
            try:
                items.append((self.encode(key, f"{where} key {key!r}"), self.encode(item, f"{where}[{key!r}]")))
            except _Unencodable as error:
                del self.tensors[kept_tensors:]
                self.dropped.append(str(error))
        if all(isinstance(key, str) and key != _TAG for key, _ in items):
            return dict(items)
        return {_TAG: "dict", "items": [[key, item] for key, item in items]}


def decode_state(value: Any, tensors: list[Tensor]) -> Any:
    """The value :meth:`StateEncoder.encode` encoded, given its ``tensors`` (ValueError on an unknown tag)."""
    if isinstance(value, list):
        return [decode_state(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {key: decode_state(item, tensors) for key, item in value.items()}
    if kind == "tuple":
        return tuple(decode_state(v, tensors) for v in value["items"])
    if kind == "dict":
        return {decode_state(key, tensors): decode_state(item, tensors) for key, item in value["items"]}
    if kind == "tensor":
        return tensors[value["index"]]
    raise ValueError(f"unknown tag {kind!r}")
