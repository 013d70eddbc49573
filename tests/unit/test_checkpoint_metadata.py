"""A checkpoint's metadata: Lightning's state comes back exactly from JSON and a tensors file,
and what it cannot store without pickling is left out and named."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch.utilities.parsing import AttributeDict

from lightning_sparselift.checkpoint import io as ckpt
from lightning_sparselift.checkpoint.layout import FORMAT, META_FILE, TENSORS_FILE


def _same(a, b) -> bool:
    """Equal, with the same types all the way down (tensors: equal values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_metadata_round_trips_exactly_and_names_what_it_cannot_store(tmp_path):
    state = {
        "epoch": 3, "pytorch-lightning_version": "2.6.6", "inf": float("inf"),
        "loops": {"fit_loop": {"pair": (1, (2.5, "a")), 7: "int key", (1, 2): "tuple key", None: [True, None]}},
        "callbacks": {"Score": {"best": torch.tensor(0.25), "k": {"/p/epoch=0.ckpt": torch.tensor([1.0, 2.0])}}},
        "user": {"$sparselift": "a key that looks like our tag"},
        "hyper_parameters": AttributeDict(lr=0.1, dims=(8, 16)),
        "loss_fn": lambda x: x,
        "mixed": {"keep": 1, "drop": object()},
    }
    expected = {k: v for k, v in state.items() if k != "loss_fn"}
    expected.update(hyper_parameters={"lr": 0.1, "dims": (8, 16)}, mixed={"keep": 1})
    path = tmp_path / "x.ckpt"
    for step in (1, 2):  # the second save replaces the first
        folder = tmp_path / f"x.ckpt.partial-{step}"
        folder.mkdir()
        (folder / "shard.distcp").write_bytes(b"step %d" % step)
        with pytest.warns(RuntimeWarning, match=r"left out checkpoint\['loss_fn'\] \(function\), "
                                                 r"checkpoint\['mixed'\]\['drop'\] \(object\)"):
            ckpt.commit(folder, path, {**state, "global_step": step}, {"tables": {}}, {}, has_optimizer=False)
    lightning, info = ckpt.read_meta(path)
    assert _same(lightning, {**expected, "global_step": 2})
    assert info == {"fingerprint": {"tables": {}}, "plan": {}, "has_optimizer": False}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]
    assert sorted(p.name for p in path.iterdir()) == ["shard.distcp", META_FILE, TENSORS_FILE]
    assert json.loads((path / META_FILE).read_text())["format"] == FORMAT
