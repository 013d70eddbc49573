"""TorchRec's train pipelines: ``torchrec-base`` (``TrainPipelineBase``) and ``torchrec``
(``TrainPipelineSparseDist``: the input dist of batch i+1 during batch i); ``torchrec-qcomm``:
``torchrec`` with TorchRec's quantized communication (FP16 forward, BF16 backward: its usual
setting, which TorchRec's CPU registry turns into FP16 both ways); ``torchrec-mx4``: with MX4 both
ways, the quality check's deliberately degraded setting (``bench/parity.py``)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from lightning_sparselift.bench.systems.base import System, build_sharded


class _TorchRecPipeline(System):
    """TorchRec DistributedModelParallel (its planner, fused TBE, DDP dense) driven by one of
    TorchRec's train pipelines."""

    pipeline_class: Callable[..., Any]
    wire: Optional[tuple[str, str]] = None  # TorchRec's quantized communication: qcomms_config(*wire)

    def setup(self) -> None:
        # (TorchRec as its users run it: no generated kernel, so no Adam on CPU tables)
        dmp, optimizer, wrapped, _ = build_sharded(self.env, validate_inputs=False, generated_adam=False,
                                                   qcomms_config=qcomms_config(*self.wire) if self.wire else None)
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
    wire = ("FP16", "BF16")


class TorchRecMX4(TorchRecSparseDist):
    name = "torchrec-mx4"
    wire = ("MX4", "MX4")


def qcomms_config(forward: str = "FP16", backward: str = "BF16") -> Any:
    """TorchRec's quantized communication (``CommType`` names); the default is what the ``-qcomm``
    systems run: TorchRec's usual FP16 / BF16."""
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

    return QCommsConfig(forward_precision=CommType[forward], backward_precision=CommType[backward])
