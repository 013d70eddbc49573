"""TorchRec's train pipelines: ``torchrec-base`` (``TrainPipelineBase``) and ``torchrec``
(``TrainPipelineSparseDist``: the input dist of batch i+1 during batch i); ``torchrec-qcomm``:
``torchrec`` with TorchRec's quantized communication (FP16 forward, BF16 backward: its usual
setting, which TorchRec's CPU registry turns into FP16 both ways)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightning_sparselift.bench.systems.base import System, build_sharded


class _TorchRecPipeline(System):
    """TorchRec DistributedModelParallel (its planner, fused TBE, DDP dense) driven by one of
    TorchRec's train pipelines."""

    pipeline_class: Callable[..., Any]
    quantized = False  # with qcomms_config()

    def setup(self) -> None:
        # (TorchRec as its users run it: no generated kernel, so no Adam on CPU tables)
        dmp, optimizer, wrapped, _ = build_sharded(self.env, validate_inputs=False, generated_adam=False,
                                                   qcomms_config=qcomms_config() if self.quantized else None)
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



class TorchRecQComm(TorchRecSparseDist):
    name = "torchrec-qcomm"
    quantized = True


def qcomms_config() -> Any:
    """The quantized communication the ``-qcomm`` systems run: TorchRec's usual FP16 / BF16."""
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

    return QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16)
