"""What the model does with a pooled module's output, as the captured steps show it: the values of
the KeyedTensor the module returned are traced (a tensor subclass that computes exactly as a
plain tensor and returns plain tensors), so capture sees the per-key views the model takes
(``to_dict``, ``kt[key]``), the ``torch.cat`` they go into and any other use. The consumer layout
(:mod:`lightning_sparselift.runtime.consumer_layout`) needs one concatenation of every key's
values along the key dim and nothing else reading them; anything else is said in words.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

# the operations that concatenate, and that take per-key views (KeyedTensor.to_dict splits, kt[key] narrows)
CATS = (torch.cat, torch.concat, torch.concatenate)
SPLITS = (torch.Tensor.split, torch.split, torch.Tensor.split_with_sizes)
NARROWS = (torch.Tensor.narrow, torch.narrow)


class OutputTrace:
    """One call's pooled output: the concatenations its per-key views went into (key order, the
    widths of the other operands before and after them) and every other operation that read it."""

    def __init__(self, keys: list[str], dims: list[int]) -> None:
        self.keys, self.dims = keys, dims
        self.concatenations: list[tuple[list[int], Optional[int], Optional[int]]] = []
        self.other: list[str] = []
        self.behind = False  # concatenated after another module's values

    def wrap(self, kt: Any) -> Any:
        """``kt`` with its values traced."""
        values = kt.values().as_subclass(_TracedValues)
        values._trace = self
        return with_values(kt, values)

    def result(self) -> tuple[Optional[list[Any]], str]:
        """([key order, before, after], "") for one concatenation of every key and no other use,
        else (None, what the model did)."""
        if self.other:
            return None, f"the model reads the pooled values with {', '.join(sorted(set(self.other))[:3])}"
        if self.behind:
            return None, ("the model concatenates them after another sharded module's values (that module's "
                          "layout holds the concatenation)")
        if len(self.concatenations) != 1:
            return None, ("the model does not concatenate the pooled values" if not self.concatenations else
                          f"the model concatenates the pooled values {len(self.concatenations)} times")
        order, before, after = self.concatenations[0]
        if sorted(order) != list(range(len(self.keys))) or before is None or after is None:
            return None, (f"the model's concatenation holds {len(order)} of the {len(self.keys)} keys' values "
                          f"(in one run: {before is not None and after is not None}) and operands that are not "
                          f"two-dimensional")
        return [[self.keys[i] for i in order], before, after], ""


def with_values(kt: Any, values: Tensor) -> Any:
    """The KeyedTensor ``kt`` (its keys, widths and key dim) holding ``values`` instead (e.g. its
    own as a tensor subclass)."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    return KeyedTensor(keys=list(kt.keys()), length_per_key=list(kt.length_per_key()), values=values,
                       key_dim=kt.key_dim())


def _traces(args: tuple) -> list[OutputTrace]:
    found: list[OutputTrace] = []
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(t, _Traced) and t._trace not in found:
                found.append(t._trace)
    return found


def dim_argument(args: tuple, kwargs: dict, position: int) -> int:
    """The ``dim`` an operation on two-dimensional tensors was called with (positional at
    ``position`` or by keyword; default 0), counted from the front."""
    dim = kwargs.get("dim", args[position] if len(args) > position else 0)
    return dim + 2 if dim < 0 else dim


class _Traced(Tensor):
    _trace: OutputTrace

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if any(not issubclass(t, _Traced) for t in types):
            return NotImplemented  # another type's protocol first (e.g. TorchRec's LazyAwaitable: it waits)
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if args and isinstance(args[0], _TracedValues) and func in SPLITS + NARROWS:
            return _tag_views(args[0]._trace, func, args, kwargs, result)
        if func in CATS:
            for trace in _traces(args):
                _record_concatenation(trace, args, kwargs)
            return result
        produced = result if isinstance(result, (list, tuple)) else [result]
        if any(isinstance(r, Tensor) for r in produced):  # (metadata such as .shape or .dtype is no use)
            for trace in _traces(args):
                trace.other.append(getattr(func, "__qualname__", str(func)))
        return result


class _TracedValues(_Traced):
    pass


class _TracedView(_Traced):
    _key: int


def key_views(func: Any, args: tuple, kwargs: dict, result: Any, dims: list[int]) -> list[tuple[Tensor, int]]:
    """The views a split or narrow (``func`` called with ``args``, giving ``result``) of a
    KeyedTensor's values made, each with the key whose columns it is exactly (-1: none); ``dims``:
    the keys' widths, in order."""
    starts = [sum(dims[:i]) for i in range(len(dims))]
    if func in NARROWS:
        dim = dim_argument(args, kwargs, 1)
        pieces = [result]
        places = [(kwargs.get("start", args[2] if len(args) > 2 else None),
                   kwargs.get("length", args[3] if len(args) > 3 else None))]
    else:
        dim = dim_argument(args, kwargs, 2)
        pieces, places, column = list(result), [], 0
        for p in pieces:
            width = p.size(dim) if p.dim() > dim else 0
            places.append((column, width))
            column += width
    out = []
    for piece, (start, length) in zip(pieces, places):
        key = starts.index(start) if dim == 1 and start in starts else -1
        out.append((piece, key if key >= 0 and dims[key] == length else -1))
    return out


def _tag_views(trace: OutputTrace, func: Any, args: tuple, kwargs: dict, result: Any) -> Any:
    """The views that are exactly one key's columns, tagged with the key; any other is a use."""
    out = []
    for piece, key in key_views(func, args, kwargs, result, trace.dims):
        if key >= 0:
            piece = piece.as_subclass(_TracedView)
            piece._trace, piece._key = trace, key
        else:
            trace.other.append(f"{getattr(func, '__qualname__', func)} (not one key's columns)")
        out.append(piece)
    return out[0] if func in NARROWS else type(result)(out)


def _record_concatenation(trace: OutputTrace, args: tuple, kwargs: dict) -> None:
    tensors = list(kwargs.get("tensors", args[0] if args else []))
    mine = [i for i, t in enumerate(tensors) if isinstance(t, _TracedView) and t._trace is trace]
    if dim_argument(args, kwargs, 1) != 1 or any(isinstance(t, _TracedValues) and t._trace is trace for t in tensors):
        trace.other.append("torch.cat (of the values, or not along the key dim)")
        return
    if any(isinstance(t, _TracedView) for t in tensors[:mine[0]]):
        trace.behind = True
        return
    in_one_run = mine == list(range(mine[0], mine[-1] + 1))
    others_2d = all(t.dim() == 2 for t in tensors)
    before = sum(t.size(1) for t in tensors[:mine[0]]) if in_one_run and others_2d else None
    after = sum(t.size(1) for t in tensors[mine[-1] + 1:]) if in_one_run and others_2d else None
    trace.concatenations.append(([tensors[i]._key for i in mine], before, after))
