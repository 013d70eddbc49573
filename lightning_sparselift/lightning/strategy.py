"""``SparseLiftStrategy``: the Lightning glue.

It shards every TorchRec ``EmbeddingBagCollection``, ``EmbeddingCollection`` and
``FeatureProcessedEmbeddingBagCollection`` of the LightningModule with
``DistributedModelParallel`` (tables placed by TorchRec's planner, or by a constructed plan
where the planner cannot place them), keeps the dense part data-parallel, runs the embedding
optimizer fused into backward next to the user's dense optimizer, and saves sharded checkpoints.
With ``executor="sparselift"`` (the default) its hooks drive the
:class:`~lightning_sparselift.session.SparseLiftSession` (capture -> lift -> plan -> install) on
the first training steps, and the lifted executor runs the plan for the rest of the run:
``on_train_start`` opens the session, ``on_train_batch_start`` begins each step (announcing the
batch after it), ``optimizer_step`` ends it (``training_step`` with manual optimization), and
``on_train_end`` / ``on_exception`` stop a session that has not finished.
"""

from __future__ import annotations

import atexit
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection, _distributed_is_initialized, _get_default_process_group_backend_for_device,
    _init_dist_connection, _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override
from torch import Tensor

from lightning_sparselift.checkpoint import compatibility
from lightning_sparselift.checkpoint import folder as checkpoint_folder
from lightning_sparselift.checkpoint import io as ckpt
from lightning_sparselift.cost.decision import DecisionRule
from lightning_sparselift.lightning import console
from lightning_sparselift.lightning.launcher import DenseOnlyMultiProcessingLauncher
from lightning_sparselift.lightning.lookahead import LookaheadLoader
from lightning_sparselift.lightning.report import report_events, report_metrics, report_round
from lightning_sparselift.sharding import EmbeddingOptimizer, combine_optimizers, plan_summary, shard_model
from lightning_sparselift.lightning.signals import SignalConnector
from lightning_sparselift.lightning.step_check import NON_FINITE_POLICIES, StepCheck
from lightning_sparselift.options import SessionOptions

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph
    from lightning_sparselift.plan import ExecutionPlan
    from lightning_sparselift.runtime import InstalledExecutor
    from lightning_sparselift.session import SparseLiftSession

EXECUTORS = ("torchrec", "sparselift")
START_METHODS = ("popen", "spawn", "fork")
EMBEDDING_LR_SCHEDULES = ("constant", "follow_dense")


class SparseLiftStrategy(ParallelStrategy):
    """Train TorchRec-sharded recommendation models with Lightning, on 1..N CPU processes over
    gloo or on GPUs over NCCL.

    Args:
        sharding_types: table name -> TorchRec sharding type (``table_wise``, ``column_wise``,
            ``table_column_wise``, ``row_wise``, ``table_row_wise``, ``data_parallel``; as the
            table's module's TorchRec sharder offers). Unlisted tables are placed by TorchRec's
            planner (table-wise on the least loaded rank when the plan has to be constructed, as
            for row-wise and table-row-wise on CPU).
        embedding_optimizer: the optimizer fused into the model-parallel tables' backward: a
            name (``sgd``, ``adagrad``, ``rowwise_adagrad``; ``adam``, which on CPU tables only
            the generated kernel runs), a dict (``{"name": ..., "lr": ...}``) or an
            :class:`~lightning_sparselift.sharding.EmbeddingOptimizer`. ``data_parallel`` tables
            are replicated dense parameters: TorchRec all-reduces their gradients and the dense
            optimizer from ``configure_optimizers`` updates them.
        embedding_lr_schedule: ``constant`` keeps the embedding LR fixed; ``follow_dense``
            scales it by the dense optimizer's current/initial LR ratio every step, so the LR
            scheduler from ``configure_optimizers`` (which drives the dense optimizer) drives
            both.
        executor: ``sparselift`` (default) captures the first ``warmup_batches`` training steps on
            TorchRec's path, lifts the sparse path into a graph (:attr:`sparse_graph`) and runs it
            with SparseLift's executor from then on (bit-identical results); if the model's sparse
            path cannot be lifted, it warns and keeps TorchRec's path. ``torchrec`` always runs
            TorchRec's sharded modules as they are.
        optimizations: the sparse-path optimization passes the planner may use (default: all of
            them: ``aggregation``, ``codegen``, ``latency_hiding``, ``subgraph_parallelism``);
            ``pass:role`` selects one kind of
            candidate, e.g. ``latency_hiding:early_start`` (without the next-batch schedule);
            ``[]`` runs the identity plan. Unknown names raise.
        calibrate: decide every feasible candidate by measuring it on real training steps
            (default); ``False`` applies every feasible candidate without measuring.
        calibration_confidence: a candidate is accepted only when its measured step change is
            below minus ``calibration_min_gain`` with this confidence (paired steps, Wilcoxon
            signed-rank bounds; see :mod:`lightning_sparselift.cost.decision`).
        calibration_max_pairs: the measured pairs (incumbent step, candidate step) one candidate
            may use while it is undecided (default 256); still undecided after them, it is
            rejected. A candidate whose estimate is not half the smallest gain after 48 pairs
            stops there (negligible).
        calibration_min_gain: the smallest improvement a candidate measured on whole steps or the
            executor's sparse regions (latency hiding, aggregation) must show (beyond the noise),
            as a fraction of the incumbent's step time, to be accepted (default 0.005).
        calibration_min_lookup_gain: the same for candidates measured on the lookup regions or
            the input side (code generation, subgraph parallelism), whose clock resolves smaller effects
            (default 0.001). No candidate is accepted before 16 measured pairs.
        workspace_budget_mb: the memory (MiB per rank) a plan's schedule may hold beyond the
            identity plan's as workspace; a candidate that needs more is infeasible, with the
            numbers in ``explain()`` (subgraph parallelism: the backward scratch of the buckets
            that run at once). None (default): no limit.
        reuse_buffers: on CPU, the buffers the lifted executor fills every step (generated
            lookups' outputs, what the all-to-alls receive, the consumer layout's tensor, gradient
            send buffers) keep their memory from step to step instead of being allocated (and
            page-faulted in) again; memory something still holds (e.g. a step's output the model
            kept) is never handed out again (default True). Between steps each site keeps at most
            two blocks.
        numerics: ``"exact"`` (default): only generated kernels whose results are bit-identical
            to TorchRec's / fbgemm's run (the C++ kernels on CPU); ``"fast"`` also lets kernels
            whose rounding may differ run: the Triton kernels on CUDA tables, whose bit identity
            with fbgemm's CUDA kernels is not established (see docs/options.md for their error bound).
        plan_path: a JSON file for the execution plan: reused (no calibration) when it was made
            for the same model, sharding plan, world size, backend and versions and its graph is
            what its accepted candidates give on this run's lift; otherwise planned again and
            (over)written. The file is a cache: a bad one is logged and ignored, a failed write
            warns.
        warmup_batches: training steps captured on TorchRec's path before lifting (>= 1 with the
            lifted executor).
        verify_steps: after a calibrated plan that differs from the identity plan is installed
            (planned or reused), about this many training steps alternate between it and the
            identity plan (in pairs, with a settle step before each measured one when the plan
            distributes the next batch a step ahead; at least 1 warmup + 7 measured pairs); the
            paired step times are judged like calibration's (the slowest rank's, signed-rank bounds at
            ``calibration_confidence``). Slower beyond noise, the identity plan is installed
            instead (a warning with the numbers). Predicted, calibrated and measured step change
            go to the logger (``sparselift/verify/...``) and the session's ``explain()``. ``0``:
            no check. Not done with ``calibrate=False``.
        replan_on_drift: every 10 steps the ranks compare the lifted modules' live workload with
            the statistics the installed plan was decided on (one small all-gather); when a
            feature's mean bag length exceeds ``drift_ratio`` x its planned p99 bag length (at
            least 1), its ids per step fall below 1/``drift_ratio`` of the planned, or the batch
            size changed for a whole check window, a new planning round runs on the live
            statistics (logged with them, ``sparselift/drift/...``). ``False``: warn only. A
            reused ``plan_path`` file is checked against this run's captured statistics the same
            way (and not reused when they drifted).
        drift_ratio: the threshold factor of ``replan_on_drift`` (> 1).
        min_steps_between_replans: a drift re-plan starts at least this many training steps
            after the previous planning round began (drift found earlier waits, logged once).
        timeout: collective timeout (seconds or ``timedelta``).
        process_group_backend: ``gloo`` / ``nccl``; defaults from the device.
        start_method: ``popen`` (re-runs the script, like DDP), ``spawn`` or ``fork`` (notebooks).
        validate_inputs: check every batch's KJT (keys, dtypes, lengths against ids, id ranges)
            before the sharded lookup (fbgemm's CPU kernels would otherwise read out of bounds
            silently), and compare the ranks' inputs (batch sizes, dtypes) in one small
            all-gather, so every rank raises the same error before a collective can mismatch.
        allow_optimizer_state_reset: when resuming into a different sharding plan, load the
            weights and restart the fused optimizer state instead of raising.
        non_finite: what a training step with non-finite values in the batch's floating-point
            tensors (its KJTs' weights included) or in the loss on any rank does, before backward
            applies any update (on every schedule: see ``runtime/update_guard.py``):
            ``raise`` (default) stops every rank with an error naming the batch, tensor, feature
            and rank; ``skip`` skips that step on every rank with a warning.
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
        calibration_min_gain: float = DecisionRule.min_gain,
        calibration_min_lookup_gain: float = DecisionRule.min_lookup_gain,
        workspace_budget_mb: Optional[float] = None,
        reuse_buffers: bool = True,
        numerics: str = "exact",
        plan_path: Optional[str] = None,
        warmup_batches: int = 3,
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
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        if sharding_types is not None and not isinstance(sharding_types, dict):
            raise TypeError(f"sharding_types must be a dict table -> type, got {type(sharding_types).__name__}")
        if non_finite not in NON_FINITE_POLICIES:
            raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        if embedding_lr_schedule not in EMBEDDING_LR_SCHEDULES:
            raise ValueError(f"embedding_lr_schedule must be one of {EMBEDDING_LR_SCHEDULES}, "
                             f"got {embedding_lr_schedule!r}")
        if int(warmup_batches) < (1 if executor == "sparselift" else 0):
            raise ValueError(f"warmup_batches must be >= 1 with executor='sparselift' (TorchRec's path runs the "
                             f"captured steps and the lift is checked against it), got {warmup_batches}")
        self.sharding_types = dict(sharding_types or {})
        self.embedding_optimizer = EmbeddingOptimizer.parse(embedding_optimizer)
        self.embedding_lr_schedule = embedding_lr_schedule
        self.executor = executor
        if workspace_budget_mb is not None and not float(workspace_budget_mb) >= 0:
            raise ValueError(f"workspace_budget_mb must be >= 0 (MiB per rank) or None, got {workspace_budget_mb!r}")
        # what the compiler session runs with (validated here, once)
        self.session_options = SessionOptions(
            warmup_batches=int(warmup_batches), calibrate=bool(calibrate),
            **({} if optimizations is None else {"optimizations": tuple(optimizations)}),
            plan_path=str(plan_path) if plan_path is not None else None,
            decision_rule=DecisionRule(float(calibration_confidence), int(calibration_max_pairs),
                                       float(calibration_min_gain), float(calibration_min_lookup_gain)),
            workspace_budget_bytes=None if workspace_budget_mb is None else int(float(workspace_budget_mb) * 2**20),
            reuse_buffers=bool(reuse_buffers), numerics=numerics, verify_steps=int(verify_steps),
            replan_on_drift=bool(replan_on_drift), drift_ratio=float(drift_ratio),
            min_steps_between_replans=int(min_steps_between_replans))
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._process_group_backend = process_group_backend
        self._start_method = start_method
        self.validate_inputs = validate_inputs
        self.allow_optimizer_state_reset = allow_optimizer_state_reset
        self.non_finite = non_finite
        self._step_check: Optional[StepCheck] = None
        self._check_group: Any = None  # created with the process group (setup_environment)
        self.num_nodes = 1
        self._dmp: Optional[torch.nn.Module] = None
        self._tables: dict[str, Any] = {}
        self.sparse_module_paths: list[str] = []
        # initial LRs, the reference of embedding_lr_schedule="follow_dense"
        self._dense_base_lr = 1.0
        self._embedding_base_lrs: list[float] = []
        self._session: Optional[SparseLiftSession] = None  # kept once done (its executor and plan)
        self._lookahead: Optional[LookaheadLoader] = None  # the training dataloader, read one batch ahead
        self._next_batch: Any = None  # the batch after the one being moved to the device for training

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="SparseLift (re-runs the script per rank)",
                                   override=True)
        for method in ("spawn", "fork"):
            strategy_registry.register(f"{cls.strategy_name}_{method}", cls, start_method=method,
                                       description=f"SparseLift with the {method} launcher", override=True)

    # ------------------------------------------------------------------ processes and collectives
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Under torchrun, SLURM, ... the rank processes exist already: as with popen, this launcher
        # then only checks the settings against the environment and starts nothing (the fork/spawn
        # launchers would start every rank again inside each rank).
        if self._start_method == "popen" or self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = DenseOnlyMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        console.install()  # in every rank process: the library warnings we cannot avoid
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        initialized = _distributed_is_initialized()
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
        if not initialized and self._process_group_backend != "nccl":  # (Lightning registers it for NCCL)
            # a gloo group left to the interpreter's finalization can abort the process at exit
            # ("terminate called without an active exception"): destroy it while Python is alive
            atexit.register(_destroy_dist_connection)
        # The checks of every step (inputs compared across ranks, non-finite values) get their own
        # process group: collectives on one group run in order, and on the training group they
        # would wait behind the next batch's input all-to-alls that latency hiding leaves in flight.
        self._check_group = torch.distributed.new_group(backend=self._process_group_backend, timeout=self._timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def model_to_device(self) -> None:
        # Tables are created by the sharding on the right device; the dense part moves there in setup.
        pass

    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None):
        return nullcontext()

    # ------------------------------------------------------------------ sharding
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        # the trainer registers its signal handlers after setup, through this connector: a SIGTERM
        # handler that starts no collective (see lightning_sparselift.lightning.signals)
        if not isinstance(trainer._signal_connector, SignalConnector):
            trainer._signal_connector = SignalConnector(trainer)
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                f"SparseLiftStrategy cannot accumulate gradients (accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}): the embedding optimizer is fused into backward and updates "
                f"the tables at every backward pass. Use a larger batch size instead.")
        if type(self.precision_plugin) is not Precision:
            raise MisconfigurationException(f"SparseLiftStrategy supports only precision='32-true', got "
                                            f"{type(self.precision_plugin).__name__}")
        if self._dmp is None:
            self._dmp = self._shard(self.lightning_module)
        self.model = self._dmp
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _shard(self, module: torch.nn.Module) -> torch.nn.Module:
        sharded = shard_model(module, self.world_size, self.root_device, self.sharding_types,
                              self.embedding_optimizer, torch.distributed.group.WORLD,
                              self._check_group if self.validate_inputs else None)
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
        return self._session

    @property
    def sparse_graph(self) -> Optional[SparseGraph]:
        """The lifted :class:`~lightning_sparselift.ir.SparseGraph` the executor runs, after the
        plan's passes (None until a plan is installed, or when TorchRec's path is in use)."""
        return self.lifted_executor.graph if self.lifted_executor is not None else None

    @property
    def lifted_executor(self) -> Optional[InstalledExecutor]:
        """The installed :class:`~lightning_sparselift.runtime.InstalledExecutor` (None until a
        plan is installed, or when TorchRec's path is in use)."""
        return self._session.installed if self.execution_plan is not None else None

    @property
    def execution_plan(self) -> Optional[ExecutionPlan]:
        """The installed :class:`~lightning_sparselift.plan.ExecutionPlan` (None until a plan is
        installed, or when TorchRec's path is in use)."""
        return self._session.plan if self._session is not None else None

    @property
    def executor_fallback_reason(self) -> Optional[str]:
        """Why TorchRec's path was kept (None while the lifted executor runs or before the session decided)."""
        return self._session.fallback_reason if self._session is not None else None

    @property
    def executor_in_use(self) -> str:
        """``sparselift`` once the lifted executor is installed (calibration included), else ``torchrec``."""
        return "sparselift" if self._session is not None and self._session.installed is not None else "torchrec"

    # ------------------------------------------------------------------ the SparseLift session
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.executor == "sparselift" and trainer is not None and trainer.training:
            self._lookahead = LookaheadLoader(dataloader)
            return self._lookahead
        return dataloader

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # the loop passes the batch exactly as the training loader yielded it, so the lookahead knows what follows
        self._next_batch = self._lookahead.after(batch) if self._lookahead is not None else None
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_start(self) -> None:
        self._check_equal_batch_counts("fit")
        # every rank checks the batch and the loss before backward applies any (fused) update
        if self._step_check is None:
            self._step_check = StepCheck(self._check_group, self.non_finite, self.lightning_module,
                                         self.sparse_module_paths)
        # an installed executor is kept across fits; a session that kept TorchRec's path tries again
        if self.executor == "sparselift" and (self._session is None or self._session.installed is None):
            from lightning_sparselift.session import SparseLiftSession

            self._session = SparseLiftSession(self.lightning_module, self._dmp.plan, self.sparse_module_paths,
                                              torch.distributed.group.WORLD, self.root_device, self.session_options,
                                              self._check_group, self._step_check.before_update)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._session is None:
            return
        if batch_idx == 0:
            # the previous epoch's last step may have announced a batch it never reached
            # (limit_train_batches, on_train_batch_start returning -1): an epoch starts from scratch
            self._discard_started_work()
        # announced as the loader yields it: the transfer hooks run once, when its step comes
        # (capture checked that the model receives exactly these features, else the schedule is
        # not proposed; the executor moves them to its device)
        self._session.begin_step(batch, self._next_batch)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", -1)
        self._step_check.inspect(batch)
        output = super().training_step(*args, **kwargs)
        output = self._step_check.verdict(output, batch_idx, self.lightning_module.trainer.global_step)
        if not self.lightning_module.automatic_optimization:
            self._end_step()  # the user's optimizer steps ran inside training_step
        return output

    @property
    def skipped_steps(self) -> int:
        """Training steps skipped on every rank (empty batches everywhere; ``non_finite='skip'``)."""
        return self._step_check.skipped if self._step_check is not None else 0

    def _end_step(self) -> None:
        """The step's forward, backward and optimizer step ran: the session records it and
        advances; its progress is reported from here (a hook where Lightning allows logging)."""
        if self._session is None:
            return
        finished = self._session.end_step()
        report_events(self._session)
        module = self.lightning_module
        progress = self._session.calibration_progress
        if progress is not None:
            module.log("sparselift/calibration_step", float(progress[0]), prog_bar=True, rank_zero_only=True)
        if finished:
            report_round(self._session, module)
        report_metrics(self._session, module)

    def _stop_session(self, why: str) -> None:
        """Training stopped: a session still running keeps what it has (see ``abandon``)."""
        if self._session is not None and not self._session.done:
            self._session.abandon(why)
            report_events(self._session)

    def _discard_started_work(self) -> None:
        """Complete and drop what the lifted executor started for a step that will not run (the
        batch announced last was never trained on: training ended, or the epoch was cut short)."""
        if self._session is not None and self._session.installed is not None:
            self._session.installed.discard()

    @override
    def on_train_end(self) -> None:
        self._stop_session(f"training ended after {self.lightning_module.trainer.global_step} step(s)")
        self._discard_started_work()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # no discard: it would wait for collectives that ranks which stopped may never join
        self._stop_session(f"training stopped by {type(exception).__name__}")

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
        self._dense_base_lr = dense.param_groups[0]["lr"]
        self._embedding_base_lrs = [g["lr"] for g in self._dmp.fused_optimizer.param_groups]
        self.optimizers = [combine_optimizers(self._dmp, dense)]

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.embedding_lr_schedule == "follow_dense":
            self._follow_dense_lr()

        def checked_closure() -> Any:  # (the closure runs forward and backward; the update follows it)
            result = closure()
            if self._step_check is not None:
                self._step_check.before_update()
            return result

        output = super().optimizer_step(optimizer, checked_closure, model, **kwargs)
        if self.lightning_module.automatic_optimization:
            self._end_step()  # the closure ran the step's forward and backward
        return output

    def _follow_dense_lr(self) -> None:
        dense = dict(self.optimizers[0].optimizers)["dense"]
        factor = dense.param_groups[0]["lr"] / self._dense_base_lr
        for group, base in zip(self._dmp.fused_optimizer.param_groups, self._embedding_base_lrs):
            group["lr"] = base * factor

    # ------------------------------------------------------------------ uneven data guard
    def _check_equal_batch_counts(self, stage: str) -> None:
        """All ranks must run the same number of sharded forwards, else a collective hangs."""
        trainer = self.lightning_module.trainer
        if stage == "fit":
            counts = [float(trainer.num_training_batches)]
        else:
            # during fit, validation runs in the fit loop's own evaluation loop
            loop = trainer.predict_loop if stage == "predict" else trainer._evaluation_loop
            counts = [float(c) for c in (loop.max_batches if isinstance(loop.max_batches, list) else [loop.max_batches])]
        local = torch.tensor(counts, dtype=torch.float64, device=self.root_device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        torch.distributed.all_gather(gathered, local)
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            fix = ("give every rank the same number of training batches (e.g. DistributedSampler with drop_last=True, "
                   "or limit_train_batches)" if stage == "fit" else
                   "use lightning_sparselift.EvenDistributedSampler (pads with zero-weight batches) for this dataloader")
            raise RuntimeError(
                f"ranks have different numbers of {stage} batches ({[g.tolist() for g in gathered]}); sharded "
                f"embeddings need every rank to run the same number of forwards: {fix}.")

    @override
    def on_validation_start(self) -> None:
        self._check_equal_batch_counts("validate")

    @override
    def on_test_start(self) -> None:
        self._check_equal_batch_counts("test")

    @override
    def on_predict_start(self) -> None:
        self._check_equal_batch_counts("predict")

    # ------------------------------------------------------------------ checkpoints
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
        # every rank writes into a new folder named by rank 0, which renames it into place once complete
        path, folder = self._on_rank_zero(checkpoint_folder.start_save, Path(filepath))
        lightning_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        optimizer = self.optimizers[0] if self.optimizers else None
        ckpt.write_shards(folder, self._dmp, optimizer, self.global_rank)
        self.barrier()  # every rank's files are on disk before rank 0 checksums them
        self._on_rank_zero(ckpt.commit, folder, path, lightning_state, self._fingerprint(),
                           plan_summary(self._dmp.plan), optimizer is not None)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # weights_only changes nothing: a checkpoint's metadata is JSON and weights-only tensors
        path = Path(self.broadcast(str(checkpoint_path)))
        lightning_state, info = self._on_rank_zero(ckpt.read_meta, path)
        optimizer = self.optimizers[0] if self.optimizers else None
        ckpt.load(path, self._dmp, optimizer, info, self.global_rank, self._fingerprint(),
                  plan_summary(self._dmp.plan), self.allow_optimizer_state_reset)
        lightning_state["state_dict"] = {}
        if optimizer is not None and self.embedding_lr_schedule == "follow_dense":
            self._follow_dense_lr()
        return lightning_state

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            checkpoint_folder.remove(Path(filepath))

    def _on_rank_zero(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run by rank 0; every rank returns its result or raises its error (a rank
        raising alone would leave the others waiting in the next collective)."""
        outcome: tuple[Any, Optional[Exception]] = (None, None)
        if self.is_global_zero:
            try:
                outcome = (fn(*args), None)
            except Exception as error:
                outcome = (None, error)
        result, error = self.broadcast(outcome)
        if error is not None:
            raise error
        return result

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_dmp"] = None  # the spawn launcher pickles the strategy before any sharding happens
        return state
