"""TorchRec's train pipelines: ``torchrec-base`` (``TrainPipelineBase``) and ``torchrec``
(``TrainPipelineSparseDist``: the input dist of batch i+1 during batch i)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightning_sparselift.bench.systems.base import System, build_sharded


class _TorchRecPipeline(System):
    """TorchRec DistributedModelParallel (its planner, fused TBE, DDP dense) driven by one of
    TorchRec's train pipelines."""

    pipeline_class: Callable[..., Any]

    def setup(self) -> None:
        # (TorchRec as its users run it: no generated kernel, so no Adam on CPU tables)
        dmp, optimizer, wrapped, _ = build_sharded(self.env, validate_inputs=False, generated_adam=False)
        self.dmp, self.optimizer = dmp, optimizer
        self.pipeline = self.pipeline_class(model=dmp, optimizer=optimizer, device=torch.device("cpu"))
        self.batches = self.env.local_iterator()
        self._timed_sharded(wrapped, optimizer)

    def step(self, step: int) -> None:
        self.pipeline.progress(self.batches)  # returns the logits; the loss stays inside the pipeline


class TorchRecBase(_TorchRecPipeline):
    name = "torchrec-base"

    @property
    def pipeline_class(self):
        from torchrec.distributed.train_pipeline import TrainPipelineBase

        return TrainPipelineBase


class TorchRecSparseDist(_TorchRecPipeline):
    name = "torchrec"

    @property
    def pipeline_class(self):
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        return TrainPipelineSparseDist

