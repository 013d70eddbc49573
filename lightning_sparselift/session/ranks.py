"""Every rank's value of something, so that every rank can take the same decision from it."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather(obj: Any, group: Any) -> list[Any]:
    """``obj`` from every rank of ``group``, in rank order (``[obj]`` without a process group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
