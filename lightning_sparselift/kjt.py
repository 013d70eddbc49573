"""KeyedJaggedTensors in a forward's arguments or a batch: finding them, the access paths that
name where they are, resolving and printing those paths, comparing and copying their contents.
Ground floor: capture, the runtime, passes, ``explain`` and the step check use it alike."""

from __future__ import annotations

from typing import Any, Callable

import torch


def same_features(a: Any, b: Any) -> bool:
    """Whether two KJTs hold the same keys, batch size, lengths, ids and weights (the same
    object, views of the same tensors, or equal copies, e.g. after a device transfer)."""
    if a is b:
        return True
    if list(a.keys()) != list(b.keys()) or a.stride() != b.stride():
        return False
    pairs = [(a.lengths(), b.lengths()), (a.values(), b.values())]
    wa, wb = a.weights_or_none(), b.weights_or_none()
    if (wa is None) != (wb is None):
        return False
    if wa is not None:
        pairs.append((wa, wb))
    for x, y in pairs:
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.device == y.device and x.data_ptr() == y.data_ptr() and x.stride() == y.stride():
            continue
        if not torch.equal(x, y.to(x.device)):
            return False
    return True


def copy_features(kjt: Any) -> Any:
    """A KJT holding copies of ``kjt``'s tensors: what it holds now, whatever later changes it in place."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(keys=list(kjt.keys()), values=kjt.values().clone(), lengths=kjt.lengths().clone(),
                             weights=weights.clone() if weights is not None else None, stride=kjt.stride())


def find_objects(args: tuple, kwargs: dict, match: Callable[[Any], bool], depth: int = 2
                 ) -> list[tuple[list[list[Any]], Any]]:
    """Objects for which ``match`` holds, reachable from a forward's arguments (through tuples,
    lists, dicts with string keys and object attributes, ``depth`` levels deep), each with its
    access path, in traversal order. Tensors, KJTs and scalars are leaves: never entered."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    found: list[tuple[list[list[Any]], Any]] = []

    def walk(obj: Any, path: list[list[Any]], left: int) -> None:
        if match(obj):
            found.append((path, obj))
            return
        if left == 0 or isinstance(obj, (torch.Tensor, KeyedJaggedTensor, str, bytes, int, float)):
            return
        if isinstance(obj, (tuple, list)):
            for i, item in enumerate(obj):
                walk(item, path + [["item", i]], left - 1)
        elif isinstance(obj, dict):
            for key, item in obj.items():
                if isinstance(key, str):
                    walk(item, path + [["key", key]], left - 1)
        elif hasattr(obj, "__dict__"):
            for name, item in vars(obj).items():
                walk(item, path + [["attr", name]], left - 1)

    for i, arg in enumerate(args):
        walk(arg, [["arg", i]], depth)
    for name, arg in kwargs.items():
        walk(arg, [["kwarg", name]], depth)
    return found


def kjts_with_paths(args: tuple, kwargs: dict, depth: int = 2) -> list[tuple[list[list[Any]], Any]]:
    """KeyedJaggedTensors reachable from a forward's arguments, each with its access path, in
    traversal order (see :func:`find_objects`)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return find_objects(args, kwargs, lambda obj: isinstance(obj, KeyedJaggedTensor), depth)


def find_kjts(args: tuple, kwargs: dict, depth: int = 2) -> dict[int, list[list[Any]]]:
    """KeyedJaggedTensors reachable from a forward's arguments: id -> the first access path to it."""
    found: dict[int, list[list[Any]]] = {}
    for path, kjt in kjts_with_paths(args, kwargs, depth):
        found.setdefault(id(kjt), path)
    return found


def resolve_path(args: tuple, kwargs: dict, path: list[list[Any]]) -> Any:
    """The object at ``path`` (from :func:`find_kjts`) in a forward's arguments, or None."""
    kind, key = path[0]
    if kind == "arg":
        obj = args[key] if key < len(args) else None
    else:
        obj = kwargs.get(key)
    for kind, key in path[1:]:
        if obj is None:
            return None
        if kind == "attr":
            obj = getattr(obj, key, None)
        elif kind == "key":
            obj = obj.get(key) if isinstance(obj, dict) else None
        else:
            obj = obj[key] if isinstance(obj, (tuple, list)) and key < len(obj) else None
    return obj


def resolve_features(args: tuple, kwargs: dict, path: list[list[Any]], keys: list[str]) -> Any:
    """The KJT at ``path`` if the object there is one with exactly ``keys`` (in order), else None.
    A captured path names a position, not a type: the same root module can be called with other
    arguments in the same step (Lightning's forward redirection passes ``(batch, batch_idx)``
    before ``training_step`` calls ``self(dense, kjt)``), so every use checks what it finds."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    found = resolve_path(args, kwargs, path)
    return found if isinstance(found, KeyedJaggedTensor) and list(found.keys()) == keys else None


def describe_path(path: list[list], name: str = "") -> str:
    """``args[0].sparse``, or ``batch.sparse`` for a path into one object called ``name``."""
    kind, key = path[0]
    text = name if name and path[0] == ["arg", 0] else f"args[{key}]" if kind == "arg" else f"kwargs[{key!r}]"
    for kind, key in path[1:]:
        text += f".{key}" if kind == "attr" else f"[{key!r}]"
    return text
