"""A checkpoint folder's model, outside the strategy: its weights as one plain, unsharded state
dict (every table whole, the keys of the LightningModule's own ``state_dict``), read in one
process after the folder passed the same checks as a resume (checksums, DCP's pickles read as
plain data first), and the LightningModule rebuilt from its saved hyper-parameters.

The weights are read with DCP itself (``dcp.load`` into full-size tensors, ``no_dist``), which
reassembles every table from the ranks' shards, whatever the sharding plan; the optimizer state
is not read.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_sparselift.checkpoint.folder import CheckpointError
from lightning_sparselift.checkpoint.io import read_meta

_MODEL = "model."  # the prefix of the model's weights in the folder's DCP state


def export_checkpoint(path: Union[str, Path], file: Optional[Union[str, Path]] = None) -> dict[str, torch.Tensor]:
    """The model weights of the checkpoint folder ``path`` (e.g. ``ModelCheckpoint``'s
    ``epoch=0-step=8.ckpt``) as a plain state dict on CPU; also written to ``file`` with
    ``torch.save`` when given (it loads with ``torch.load(file, weights_only=True)``). Load it
    into the model built as for training, tables on meta included, with
    ``model.load_state_dict(weights, assign=True)``."""
    weights, _ = _read(Path(path))
    if file is not None:
        torch.save(weights, file)
    return weights


def load_from_checkpoint(cls: type, path: Union[str, Path], strict: bool = True, **kwargs: Any) -> Any:
    """The LightningModule ``cls`` rebuilt from the checkpoint folder ``path`` without the
    strategy: instantiated with the hyper-parameters it saved (``save_hyperparameters()``),
    ``kwargs`` overriding them, and given the folder's weights (:func:`export_checkpoint`);
    what Lightning's ``cls.load_from_checkpoint`` does for a checkpoint file (``strict``: as
    ``load_state_dict``'s)."""
    weights, lightning_state = _read(Path(path))
    saved = {k: v for k, v in (lightning_state.get("hyper_parameters") or {}).items() if not k.startswith("_")}
    parameters = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        saved = {k: v for k, v in saved.items() if k in parameters}
    module = cls(**{**saved, **kwargs})
    module.load_state_dict(weights, strict=strict, assign=True)
    return module


def main(argv: Optional[list[str]] = None) -> int:
    """``sparselift export FOLDER FILE``: the folder's model weights into one ``torch.save`` file."""
    import argparse

    parser = argparse.ArgumentParser(prog="sparselift export", description=main.__doc__)
    parser.add_argument("folder", help="a SparseLift checkpoint folder (e.g. ModelCheckpoint's epoch=0-step=8.ckpt)")
    parser.add_argument("file", help="the .pt file to write (torch.load(file, weights_only=True) reads it)")
    args = parser.parse_args(argv)
    try:
        weights = export_checkpoint(args.folder, args.file)
    except (CheckpointError, OSError) as error:
        print(f"sparselift export: {error}", file=sys.stderr)
        return 1
    count = sum(t.numel() for t in weights.values())
    print(f"{args.file}: {len(weights)} tensors, {count:,} values, from {args.folder}")
    return 0


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a SparseLift checkpoint folder (Lightning's own checkpoint files load "
                              f"with torch.load or LightningModule.load_from_checkpoint)")
    lightning_state, _ = read_meta(path)  # (checksums verified, DCP's pickles checked: safe for DCP to read)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    tensors = {fqn[len(_MODEL):]: torch.empty(m.size, dtype=m.properties.dtype)
               for fqn, m in metadata.state_dict_metadata.items()
               if fqn.startswith(_MODEL) and isinstance(m, TensorStorageMetadata)}
    if not tensors:
        raise CheckpointError(f"{path} holds no model weights")
    state = {"model": tensors}
    with warnings.catch_warnings():  # (DCP warns that it loads in one process even when told to)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["model"], lightning_state
