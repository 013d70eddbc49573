"""``SparseLiftStrategy``: the Lightning glue. It shards the LightningModule's TorchRec embedding
modules with ``DistributedModelParallel``, keeps the dense part data-parallel, runs the embedding
optimizer fused into backward beside the dense one, saves sharded checkpoints, and (with
``executor="sparselift"``) drives the compiler session from its hooks
(:mod:`~lightning_sparselift.lightning.session_connector`): the lifted executor runs the plan for
the rest of the run. Processes and process groups: :mod:`~lightning_sparselift.lightning.processes`.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation
from typing_extensions import override

from lightning_sparselift.checkpoint import compatibility
from lightning_sparselift.checkpoint import folder as checkpoint_folder
from lightning_sparselift.checkpoint import io as ckpt
from lightning_sparselift.cost.decision import DecisionRule
from lightning_sparselift.embedding_optimizer import EmbeddingLRSchedule, EmbeddingOptimizer, combine_optimizers
from lightning_sparselift.lightning.batch_counts import check_equal_batch_counts
from lightning_sparselift.lightning.processes import ProcessGroupStrategy
from lightning_sparselift.lightning.session_connector import SessionConnector
from lightning_sparselift.lightning.signals import SignalConnector
from lightning_sparselift.lightning.step_check import NON_FINITE_POLICIES, StepCheck
from lightning_sparselift.lightning.trainer_support import check_accumulation, check_trainer
from lightning_sparselift.options import SessionOptions
from lightning_sparselift.sharding import plan_summary, shard_model

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph
    from lightning_sparselift.plan import ExecutionPlan
    from lightning_sparselift.runtime import InstalledExecutor
    from lightning_sparselift.session import SparseLiftSession

EXECUTORS = ("torchrec", "sparselift")


class SparseLiftStrategy(ProcessGroupStrategy):
    """Train TorchRec-sharded recommendation models with Lightning, on 1..N CPU processes over
    gloo or on GPUs over NCCL.

    Args (each in full in docs/options.md):
        sharding_types: table name -> TorchRec sharding type (``table_wise``, ``column_wise``,
            ``table_column_wise``, ``row_wise``, ``table_row_wise``, ``data_parallel``); unlisted
            tables are placed by TorchRec's planner.
        embedding_optimizer: the optimizer fused into the tables' backward: ``sgd``, ``adagrad``,
            ``rowwise_adagrad``, ``adam`` (CPU: generated kernel only), a dict
            (``{"name": ..., "lr": ...}``) or an :class:`~lightning_sparselift.embedding_optimizer.EmbeddingOptimizer`.
        embedding_lr_schedule: ``constant``, or ``follow_dense`` (scaled by the dense optimizer's
            current/initial LR every step).
        executor: ``sparselift`` (default: capture, lift, run the lifted executor, bit-identical;
            TorchRec's path kept with a warning when the model cannot be lifted) or ``torchrec``.
        optimizations: the passes the planner may use (default all; ``pass:role`` selects one
            kind of candidate; ``[]``: the identity plan).
        calibrate: measure every feasible candidate on real training steps (default); ``False``
            applies every feasible one unmeasured.
        calibration_confidence: the confidence of the signed-rank bounds a candidate is accepted by.
        calibration_max_pairs: measured blocks (pairs) one design may use before its undecided
            candidates are rejected.
        calibration_max_steps: the calibration steps one planning round may use in all (default
            None: 240, and at most a third of the training steps left when the round starts, as
            Lightning estimates them; a number: that many, whatever the run's length).
        calibration_min_gain: the smallest improvement, as a fraction of the step, a candidate
            measured on whole steps or sparse regions must show.
        calibration_min_lookup_gain: the same for candidates measured on lookups or the input side.
        workspace_budget_mb: the memory (MiB per rank) a plan may hold beyond the identity plan's
            (None: no limit).
        reuse_buffers: on CPU, the executor's per-step buffers keep their memory between steps.
        numerics: ``exact`` (every value bit-identical to TorchRec's path) or ``fast`` (output
            all-to-alls may send BF16; also the Triton kernels on CUDA tables).
        plan_path: a JSON plan file, reused without calibration when made for the same setup and
            workload, else (over)written; a cache.
        capture_steps: training steps captured on TorchRec's path before lifting (>= 1).
        warmup_batches: deprecated name of ``capture_steps``.
        verify_steps: steps alternating the installed plan with the identity plan, rolled back when
            slower beyond noise (``0``: no check).
        replan_on_drift: plan again when the workload drifts from what the plan was decided on
            (``False``: warn only).
        drift_ratio: the drift threshold factor (> 1).
        min_steps_between_replans: the fewest steps between the start of two planning rounds.
        timeout: collective timeout (seconds or ``timedelta``).
        process_group_backend: ``gloo`` / ``nccl``; defaults from the device.
        start_method: ``popen`` (re-runs the script, like DDP), ``spawn`` or ``fork`` (notebooks).
        validate_inputs: check every batch's KJTs before the sharded lookup, the same verdict on
            every rank.
        allow_optimizer_state_reset: resuming into another sharding plan, restart the fused
            optimizer state instead of raising.
        non_finite: a step with non-finite values in the batch or the loss on any rank: ``raise``
            (default) on every rank before any update, or ``skip`` it on every rank.
    """

    strategy_name = "sparselift"

    def __init__(
        self,
        sharding_types: Optional[dict[str, str]] = None,
        embedding_optimizer: Union[str, dict[str, Any], EmbeddingOptimizer] = "sgd",
        embedding_lr_schedule: str = "constant",
        executor: str = "sparselift",
        optimizations: Optional[list[str]] = None,
        calibrate: bool = True,
        calibration_confidence: float = DecisionRule.confidence,
        calibration_max_pairs: int = DecisionRule.max_pairs,
        calibration_max_steps: Optional[int] = None,
        calibration_min_gain: float = DecisionRule.min_gain,
        calibration_min_lookup_gain: float = DecisionRule.min_lookup_gain,
        workspace_budget_mb: Optional[float] = None,
        reuse_buffers: bool = True,
        numerics: str = "exact",
        plan_path: Optional[str] = None,
        capture_steps: int = 3,
        verify_steps: int = 40,
        replan_on_drift: bool = True,
        drift_ratio: float = 5.0,
        min_steps_between_replans: int = 500,
        timeout: Union[float, timedelta] = 1800.0,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        validate_inputs: bool = True,
        allow_optimizer_state_reset: bool = False,
        non_finite: str = "raise",
        qcomms_config: Optional[Any] = None,
        warmup_batches: Optional[int] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(timeout, process_group_backend, start_method, accelerator, parallel_devices,
                         cluster_environment, checkpoint_io, precision_plugin)
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        if sharding_types is not None and not isinstance(sharding_types, dict):
            raise TypeError(f"sharding_types must be a dict table -> type, got {type(sharding_types).__name__}")
        if non_finite not in NON_FINITE_POLICIES:
            raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}")
        if warmup_batches is not None:
            rank_zero_deprecation("SparseLiftStrategy(warmup_batches=...) is deprecated: it is now capture_steps")
            capture_steps = warmup_batches
        if int(capture_steps) < (1 if executor == "sparselift" else 0):
            raise ValueError(f"capture_steps must be >= 1 with executor='sparselift' (TorchRec's path runs the "
                             f"captured steps and the lift is checked against it), got {capture_steps}")
        self.sharding_types = dict(sharding_types or {})
        self.embedding_optimizer = EmbeddingOptimizer.parse(embedding_optimizer)
        self.embedding_lr = EmbeddingLRSchedule(embedding_lr_schedule)
        self.executor = executor
        # what the compiler session runs with (validated here, once)
        self.session_options = SessionOptions.from_arguments(
            optimizations, calibration_confidence, calibration_max_pairs, calibration_max_steps, calibration_min_gain,
            calibration_min_lookup_gain, workspace_budget_mb, plan_path, capture_steps=int(capture_steps),
            calibrate=bool(calibrate), reuse_buffers=bool(reuse_buffers), numerics=numerics,
            verify_steps=int(verify_steps), replan_on_drift=bool(replan_on_drift), drift_ratio=float(drift_ratio),
            min_steps_between_replans=int(min_steps_between_replans))
        self.validate_inputs = validate_inputs
        self.allow_optimizer_state_reset = allow_optimizer_state_reset
        self.non_finite = non_finite
        self.qcomms_config = qcomms_config  # TorchRec's QCommsConfig: quantized output exchanges (TorchRec's path)
        self._step_check: Optional[StepCheck] = None
        self._dmp: Optional[torch.nn.Module] = None
        self._tables: dict[str, Any] = {}
        self.sparse_module_paths: list[str] = []
        self._sessions = SessionConnector()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="SparseLift (re-runs the script per rank)",
                                   override=True)
        for method in ("spawn", "fork"):
            strategy_registry.register(f"{cls.strategy_name}_{method}", cls, start_method=method,
                                       description=f"SparseLift with the {method} launcher", override=True)

    # ------------------------------------------------------------------ sharding
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        # the trainer registers its signal handlers after setup, through this connector: a SIGTERM
        # handler that starts no collective (see lightning_sparselift.lightning.signals)
        if not isinstance(trainer._signal_connector, SignalConnector):
            trainer._signal_connector = SignalConnector(trainer)
        check_trainer(trainer, self.lightning_module, self.precision_plugin)
        if self._dmp is None:
            self._dmp = self._shard(self.lightning_module)
        self.model = self._dmp
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _shard(self, module: torch.nn.Module) -> torch.nn.Module:
        sharded = shard_model(module, self.world_size, self.root_device, self.sharding_types,
                              self.embedding_optimizer, torch.distributed.group.WORLD,
                              self.check_group if self.validate_inputs else None, qcomms_config=self.qcomms_config)
        self._tables = sharded.tables
        self.sparse_module_paths = sharded.sparse_module_paths
        return sharded.dmp

    @property
    def sharding_plan(self) -> Any:
        """TorchRec's ``ShardingPlan`` in use (after setup)."""
        if self._dmp is None:
            raise RuntimeError("the model is not sharded yet (the plan exists after Trainer setup)")
        return self._dmp.plan

    @property
    def session(self) -> Optional[SparseLiftSession]:
        """SparseLift's compiler session (None with ``executor="torchrec"`` and before the first fit);
        kept once done, with its executor and plan."""
        return self._sessions.session

    @property
    def sparse_graph(self) -> Optional[SparseGraph]:
        """The plan's :class:`~lightning_sparselift.ir.SparseGraph` (None: no plan yet, or TorchRec's path)."""
        return self.lifted_executor.graph if self.lifted_executor is not None else None

    @property
    def lifted_executor(self) -> Optional[InstalledExecutor]:
        """The :class:`~lightning_sparselift.runtime.InstalledExecutor` (None: no plan yet, or TorchRec's path)."""
        return self.session.installed if self.execution_plan is not None else None

    @property
    def execution_plan(self) -> Optional[ExecutionPlan]:
        """The installed :class:`~lightning_sparselift.plan.ExecutionPlan` (None: no plan yet, or TorchRec's path)."""
        return self.session.plan if self.session is not None else None

    @property
    def executor_fallback_reason(self) -> Optional[str]:
        """Why TorchRec's path was kept (None: the lifted executor runs, or not decided yet)."""
        return self.session.fallback_reason if self.session is not None else None

    @property
    def executor_in_use(self) -> str:
        """``torchrec`` while TorchRec's path trains (capture, a fallback, ``executor="torchrec"``),
        ``calibrating`` while the lifted executor runs a planning round's trial plans, ``sparselift``
        once it runs a plan (:attr:`execution_plan`)."""
        session = self.session
        if session is None or session.installed is None:
            return "torchrec"
        return "calibrating" if session.phase == "plan" else "sparselift"

    # ------------------------------------------------------------------ the SparseLift session
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.executor == "sparselift" and trainer is not None and trainer.training:
            return self._sessions.read_ahead(dataloader)
        return dataloader

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        self._sessions.moving(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_start(self) -> None:
        check_equal_batch_counts(self.lightning_module.trainer, "fit", self.root_device, self.world_size)
        # every rank checks the batch and the loss before backward applies any (fused) update
        if self._step_check is None:
            self._step_check = StepCheck(self.check_group, self.non_finite, self.lightning_module,
                                         self.sparse_module_paths)
        if self.executor == "sparselift":
            self._sessions.open(self.lightning_module, self._dmp.plan, self.sparse_module_paths, self.root_device,
                                self.session_options, self.check_group, self._step_check.before_update)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        trainer = self.lightning_module.trainer
        check_accumulation(trainer)
        trainer._signal_connector.requeue_if_signalled()  # (between two steps: collectives are safe here)
        self._sessions.begin_step(batch, batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", -1)
        self._step_check.inspect(batch)
        output = super().training_step(*args, **kwargs)
        return self._step_check.verdict(output, batch_idx, self.lightning_module.trainer.global_step)

    @property
    def skipped_steps(self) -> int:
        """Training steps skipped on every rank (empty batches everywhere; ``non_finite='skip'``)."""
        return self._step_check.skipped if self._step_check is not None else 0

    @override
    def on_train_end(self) -> None:
        self._sessions.stop(f"training ended after {self.lightning_module.trainer.global_step} step(s)")
        self._sessions.discard_started_work()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # no discard: it would wait for collectives that ranks which stopped may never join
        self._sessions.stop(f"training stopped by {type(exception).__name__}")

    @property
    def fused_optimizer(self) -> Any:
        """TorchRec's ``CombinedOptimizer`` over the sharded tables (after setup)."""
        if self._dmp is None:
            raise RuntimeError("the model is not sharded yet")
        return self._dmp.fused_optimizer

    # ------------------------------------------------------------------ optimizers
    @override
    def setup_optimizers(self, trainer: Any) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"SparseLiftStrategy needs configure_optimizers to return exactly one (dense) optimizer, got "
                f"{len(self.optimizers)}; the embedding optimizer is configured on the strategy")
        dense = self.optimizers[0]
        self.embedding_lr.start(dense, self._dmp.fused_optimizer)
        self.optimizers = [combine_optimizers(self._dmp, dense)]

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self.embedding_lr.step()

        def checked_closure() -> Any:  # (the closure runs forward and backward; the update follows it)
            result = closure()
            if self._step_check is not None:
                self._step_check.before_update()
            return result

        output = super().optimizer_step(optimizer, checked_closure, model, **kwargs)
        self._sessions.end_step(self.lightning_module)  # the closure ran the step's forward and backward
        return output

    # ------------------------------------------------------------------ the same batch count on every rank
    @override
    def on_validation_start(self) -> None:
        check_equal_batch_counts(self.lightning_module.trainer, "validate", self.root_device, self.world_size)

    @override
    def on_test_start(self) -> None:
        check_equal_batch_counts(self.lightning_module.trainer, "test", self.root_device, self.world_size)

    @override
    def on_predict_start(self) -> None:
        check_equal_batch_counts(self.lightning_module.trainer, "predict", self.root_device, self.world_size)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # (the model is sharded in setup: a checkpoint is loaded into its shards)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # (loaded with the weights, in load_checkpoint)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The weights go into the DCP shards in save_checkpoint.
        return {}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in load_checkpoint

    def _fingerprint(self) -> dict[str, Any]:
        return compatibility.model_fingerprint(self._dmp, self._tables, self.sparse_module_paths)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("SparseLiftStrategy.save_checkpoint does not take storage_options")
        ckpt.save(self, Path(filepath), checkpoint, self._dmp, self.optimizers[0] if self.optimizers else None,
                  self._fingerprint(), plan_summary(self._dmp.plan))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # weights_only changes nothing: a checkpoint's metadata is JSON and weights-only tensors
        optimizer = self.optimizers[0] if self.optimizers else None
        state = ckpt.restore(self, Path(checkpoint_path), self._dmp, optimizer, self._fingerprint(),
                             plan_summary(self._dmp.plan), self.allow_optimizer_state_reset)
        if optimizer is not None:
            self.embedding_lr.step()
        return state

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            checkpoint_folder.remove(Path(filepath))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_dmp"] = None  # the spawn launcher pickles the strategy before any sharding happens
        return state
