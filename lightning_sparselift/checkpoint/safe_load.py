"""Reading a checkpoint's pickles without running code from them.

The checksums catch damage, not tampering: a crafted folder can carry matching checksums, so
every pickle in it is read here first with a loader that builds plain data only. Our tensors
file is loaded weights-only; DCP's pickled ``.metadata`` is read with an unpickler that knows
only DCP's metadata classes, and DCP's non-tensor values are checked weights-only before DCP
unpickles them (with plain ``pickle``).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lightning_sparselift.checkpoint.folder import CheckpointError
from lightning_sparselift.checkpoint.layout import DCP_METADATA


def load_plain_tensors(file: Path) -> Any:
    """``torch.load(file)`` weights-only, refused unless the file holds plain tensors and data."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"{file} holds more than plain tensors and is refused "
                              f"(unpickling it could run code)") from error


_DCP_METADATA_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
}
_DTYPE_NAMES = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class _DcpMetadataUnpickler(pickle.Unpickler):
    """DCP pickles its ``.metadata`` and reads it with plain ``pickle.load``; this unpickler
    builds only DCP's metadata classes, so a file that passes it is safe for DCP to read."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


def check_dcp_files(path: Path) -> None:
    """DCP unpickles its ``.metadata`` with plain pickle (falling back to per-rank
    ``__<rank>.metadata`` files) and its non-tensor values with ``torch.load(weights_only=False)``:
    all of them are read here first, safely, and refused unless they are plain data."""
    for file in sorted(p for p in path.iterdir() if p.name.endswith(DCP_METADATA)):
        try:
            with open(file, "rb") as f:
                metadata = _DcpMetadataUnpickler(f).load()
            values = [(index.fqn, info) for index, info in metadata.storage_data.items()
                      if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)]
        except Exception as error:
            raise CheckpointError(f"{file} is not plain DCP metadata and is refused (DCP unpickles it, which "
                                  f"could run code)") from error
        for fqn, info in values:
            try:
                with open(path / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
            except Exception as error:
                raise CheckpointError(f"{path / info.relative_path}: value {fqn!r} is not plain data and is refused "
                                      f"(DCP unpickles it, which could run code)") from error
