"""Worker of the lifted-executor parity tests: trains the same model from the same weights on the
same batches twice per case, once on TorchRec's path and once with the lifted executor installed
after capture, and returns everything that must be bit-identical.

Run in spawned processes (one spawn per world size runs every case, to pay the imports once)."""

from __future__ import annotations

import os
import traceback
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sparselift.ir.vocab import ROW_SHARDED

WARMUP_STEPS = 2
LIFTED_STEPS = 3
BATCH = 8

# table name -> (rows, dim, features); ebc "b" only for the two-module cases
# (ta4 is wide enough for TorchRec's planner to split its columns into several shards)
TABLES_A = {"ta0": (50, 8, ["fa0"]), "ta1": (64, 8, ["fa1", "fa2"]), "ta2": (31, 24, ["fa3"]),
            "ta3": (100, 16, ["fa4"]), "ta4": (60, 256, ["fa5"])}
TABLES_B = {"tb0": (40, 8, ["fb0"]), "tb1": (70, 24, ["fb1"])}

CASES: dict[str, dict[str, Any]] = {
    "table_wise": dict(sharding={t: "table_wise" for t in [*TABLES_A, *TABLES_B]}),
    "column_wise": dict(sharding={t: "column_wise" for t in [*TABLES_A, *TABLES_B]}),
    "table_column_wise": dict(sharding={t: "table_column_wise" for t in [*TABLES_A, *TABLES_B]}),
    "row_wise": dict(sharding={t: "row_wise" for t in [*TABLES_A, *TABLES_B]}),
    # (one host: every table's row blocks over all ranks, in its own group beside row-wise's)
    "table_row_wise": dict(sharding={t: "table_row_wise" for t in [*TABLES_A, *TABLES_B]}),
    "data_parallel": dict(sharding={t: "data_parallel" for t in [*TABLES_A, *TABLES_B]}),
    "mixed": dict(sharding={"ta0": "table_wise", "ta1": "row_wise", "ta2": "column_wise", "ta3": "data_parallel",
                            "tb0": "row_wise", "tb1": "table_wise"}),
    # mean pooling: table-wise (fbgemm means), row-wise and table-row-wise (TorchRec sums, then
    # divides the module's whole output by bag lengths after the reduce-scatter, its sum-pooled
    # table-wise keys included)
    "mean_pooling": dict(sharding={"ta0": "table_wise", "ta1": "row_wise", "ta2": "column_wise",
                                   "ta3": "data_parallel", "ta4": "table_row_wise", "tb0": "table_row_wise",
                                   "tb1": "table_wise"},
                         mean=("ta0", "ta1", "tb0")),
    # an EmbeddingCollection's tables split into column shards on every rank (TorchRec's planner
    # keeps its narrow tables whole; a row-wise table makes us construct the plan)
    "column_shards": dict(sharding={"ta0": "row_wise", "ta1": "table_wise", "ta2": "column_wise", "ta3": "table_wise",
                                    "ta4": "column_wise", "tb0": "table_wise", "tb1": "table_wise"}),
}
POOLED_CASES = ("table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise", "data_parallel", "mixed",
                "mean_pooling")
# module "a" as an EmbeddingCollection (one width for all its tables, as TorchRec requires; wide
# enough for column-wise shards): its rows are read per position, padded to the longest bag
SEQUENCE_DIM = 48
LONGEST_BAG = 3
VARIANTS: dict[str, dict[str, Any]] = {
    "onehot": dict(weighted=False, multi_hot=False, two_modules=False),
    "multihot_weighted": dict(weighted=True, multi_hot=True, two_modules=False),
    "two_modules": dict(weighted=False, multi_hot=True, two_modules=True),
    # rank 0's batch of the last lifted step is short: that step runs TorchRec's path on all ranks
    "uneven_batch": dict(weighted=True, multi_hot=True, two_modules=False, short_step=WARMUP_STEPS + 2),
    # fused SGD (the others train with rowwise Adagrad); module "a" weighted, "b" not
    "sgd": dict(weighted=True, multi_hot=True, two_modules=True, optimizer="sgd"),
    # (TorchRec shards an EmbeddingCollection table-wise, column-wise, row-wise or data-parallel;
    # on CPU its data-parallel tables take bags of one id: fbgemm's dense kernel pools)
    "sequence": dict(weighted=False, multi_hot=True, two_modules=False,
                     sequence=("table_wise", "column_wise", "row_wise", "column_shards")),
    "sequence_onehot": dict(weighted=False, multi_hot=False, two_modules=False,
                            sequence=("table_wise", "column_wise", "row_wise", "data_parallel", "mixed")),
    # the EmbeddingCollection next to an EmbeddingBagCollection, fused SGD
    "sequence_two_modules": dict(weighted=False, multi_hot=True, two_modules=True, optimizer="sgd",
                                 sequence=("table_wise", "column_wise", "row_wise", "column_shards")),
}
# the lifted runs with passes forced on (every feasible candidate; "pass:role": only that role's)
OPTIMIZED = {"aggregated": ("aggregation",), "latency_hidden": ("latency_hiding",),
             "next_batch_only": ("latency_hiding:next_batch",), "generated": ("codegen",),
             "buckets2": ("subgraph_parallelism:buckets2",), "buckets4": ("subgraph_parallelism:buckets4",),
             "pipelined2": ("subgraph_parallelism:pipelined2",), "pipelined4": ("subgraph_parallelism:pipelined4",),
             "all_passes": ("aggregation", "latency_hiding", "codegen", "subgraph_parallelism")}
# the variants whose cases also run each pass forced on alone (multi-hot with empty bags, weights, two
# modules, sequences: the most layouts); every case runs all of them together
EACH_PASS_VARIANTS = ("multihot_weighted", "two_modules", "sequence", "sequence_two_modules")
# the cases `make test` runs on 1 and 3 ranks and with each pass alone (every sharding type of a
# pooled module in one; an EmbeddingCollection's column shards); `make test-all` runs every case so
QUICK_CASES = ("mixed", "column_shards")


def optimized(variant: str, each_pass: bool) -> dict[str, tuple[str, ...]]:
    """The lifted runs of ``variant`` with passes forced on, by name: all together, and
    (``each_pass``, for EACH_PASS_VARIANTS) each alone."""
    return OPTIMIZED if each_pass and variant in EACH_PASS_VARIANTS else {"all_passes": OPTIMIZED["all_passes"]}
# TorchRec's own row-wise backward fails on uneven batches over gloo ("ProcessGroupGloo::allgather:
# invalid tensor size"), so there is no reference to compare with.
ALL = [(c, v) for c in CASES for v in VARIANTS
       if not (v == "uneven_batch" and any(k in ROW_SHARDED for k in CASES[c]["sharding"].values()))
       and c in VARIANTS[v].get("sequence", POOLED_CASES)]


def _ebc(tables: dict[str, tuple], weighted: bool, mean: tuple[str, ...]) -> nn.Module:
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r,
                                                             feature_names=list(f),
                                                             pooling=PoolingType.MEAN if n in mean else PoolingType.SUM)
                                          for n, (r, d, f) in tables.items()],
                                  is_weighted=weighted, device=torch.device("meta"))


def _ec(tables: dict[str, tuple]) -> nn.Module:
    from torchrec import EmbeddingCollection
    from torchrec.modules.embedding_configs import EmbeddingConfig

    return EmbeddingCollection(tables=[EmbeddingConfig(name=n, embedding_dim=SEQUENCE_DIM, num_embeddings=r,
                                                       feature_names=list(f)) for n, (r, _, f) in tables.items()],
                               device=torch.device("meta"))


class ParityModel(nn.Module):
    """Dense MLP + one or two EmbeddingBagCollections (module "a" may be an EmbeddingCollection
    instead), pooled outputs read by key, sequence rows by key and position."""

    def __init__(self, weighted: bool, two_modules: bool, mean: tuple[str, ...] = (), sequence: bool = False):
        super().__init__()
        self.sequence = sequence
        self.ebc_a = _ec(TABLES_A) if sequence else _ebc(TABLES_A, weighted, mean)
        self.ebc_b = _ebc(TABLES_B, False, mean) if two_modules else None
        self.keys = [f for _, _, fs in TABLES_A.values() for f in fs]
        width = (len(self.keys) * LONGEST_BAG * SEQUENCE_DIM if sequence else
                 sum(d * len(f) for _, d, f in TABLES_A.values()))
        if two_modules:
            self.keys_b = [f for _, _, fs in TABLES_B.values() for f in fs]
            width += sum(d * len(f) for _, d, f in TABLES_B.values())
        self.bottom = nn.Linear(4, 8)
        self.top = nn.Linear(width + 8, 1)

    def forward(self, dense: torch.Tensor, kjt_a: Any, kjt_b: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        kt = self.ebc_a(kjt_a)
        if self.sequence:
            pooled = [kt[k].to_padded_dense(LONGEST_BAG).flatten(1) for k in self.keys]
        else:
            pooled = [kt[k] for k in self.keys]
        if self.ebc_b is not None:
            kt_b = self.ebc_b(kjt_b)
            pooled += [kt_b[k] for k in self.keys_b]
        pooled = torch.cat(pooled, dim=1)
        return self.top(torch.cat([torch.relu(self.bottom(dense)), pooled], dim=1)).squeeze(1), pooled


def _kjt(tables: dict[str, tuple], gen: torch.Generator, weighted: bool, multi_hot: bool, batch: int) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys, lengths, values = [], [], []
    for rows, _, features in tables.values():
        for f in features:
            keys.append(f)
            n = torch.randint(0, 4, (batch,), generator=gen) if multi_hot else torch.ones(batch, dtype=torch.long)
            lengths.append(n)
            values.append(torch.randint(0, rows, (int(n.sum()),), generator=gen))
    lengths_t, values_t = torch.cat(lengths).int(), torch.cat(values)
    weights = torch.rand(values_t.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values_t, lengths=lengths_t, weights=weights)


def batches(rank: int, variant: dict[str, Any], steps: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for step in range(steps):
        batch = BATCH - 3 if rank == 0 and step == variant.get("short_step") else BATCH
        dense = torch.randn(batch, 4, generator=gen)
        labels = torch.randint(0, 2, (batch,), generator=gen).float()
        a = _kjt(TABLES_A, gen, variant["weighted"], variant["multi_hot"], batch)
        b = _kjt(TABLES_B, gen, False, variant["multi_hot"], batch) if variant["two_modules"] else None
        out.append((dense, labels, a, b))
    return out


# c10d ops as the dispatcher names them -> the collective they implement
_COLLECTIVE_OPS = {
    "alltoall_base_": "all_to_all_single",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
}


class CollectiveRecorder(TorchDispatchMode):
    """Records the c10d collectives dispatched while active (they all pass the dispatcher, so the
    ones TorchRec issues from its awaitables and autograd Functions are seen too), each as
    ``(op, phase, module, dtype, bytes this member puts in)``. A collective issued during the
    forward of one of ``modules`` (path -> module) is ``forward`` under that path; any other is
    ``backward`` (module None)."""

    def __init__(self, modules: Optional[dict[str, nn.Module]] = None) -> None:
        super().__init__()
        self.records: list[tuple[str, str, Optional[str], str, int]] = []
        self.module: Optional[str] = None  # set while one of ``modules``' forward runs
        self._modules = modules or {}
        self._handles: list[Any] = []

    def __enter__(self) -> "CollectiveRecorder":
        for path, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(lambda *_, path=path: setattr(self, "module", path)))
            self._handles.append(module.register_forward_hook(lambda *_: setattr(self, "module", None)))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = func.__name__.split(".")[0]
        op = _COLLECTIVE_OPS.get(name) if func.namespace == "c10d" else None
        # a collective over one member moves nothing between ranks (TorchRec's table-row-wise
        # cross-host all-to-all on one host): not recorded
        groups = [a for a in args if isinstance(a, dist.ProcessGroup)]
        if op is not None and not (groups and groups[0].size() == 1 and dist.get_world_size() > 1):
            # the member's input: alltoall_base_(output, input, ...); _reduce_scatter_base_(output, input, ...);
            # _allgather_base_(output, input, ...); allreduce_([tensors], ...); coalesced ops take lists
            if name in ("alltoall_base_", "_reduce_scatter_base_", "_allgather_base_"):
                tensors = [args[1]]
            elif name in ("allreduce_", "allreduce_coalesced_"):
                tensors = list(args[0])
            else:
                tensors = list(args[1])
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            phase = "forward" if self.module is not None else "backward"
            self.records.append((op, phase, self.module, str(tensors[0].dtype).replace("torch.", ""), nbytes))
        return func(*args, **(kwargs or {}))


def local_state(model: nn.Module, fused: Any) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        shards = value.local_shards() if hasattr(value, "local_shards") else None
        if shards is None:
            out[key] = value.detach().clone()
        for i, shard in enumerate(shards or []):
            out[f"{key}#{i}"] = shard.tensor.detach().clone()
    for key, value in fused.state_dict()["state"].items():
        for name, tensor in value.items():
            for i, shard in enumerate(tensor.local_shards() if hasattr(tensor, "local_shards") else []):
                out[f"optim/{key}/{name}#{i}"] = shard.tensor.detach().clone()
    return out


def install_forced(model: nn.Module, sharded: Any, capture: Any, world: int, device: torch.device,
                   optimizations: tuple[str, ...]) -> Any:
    """After the last captured step: the lifted executor installed, every feasible candidate of
    ``optimizations`` applied (as ``calibrate=False`` would)."""
    from lightning_sparselift.frontend.capture import gather_captures
    from lightning_sparselift.frontend.check import check_against_runtime
    from lightning_sparselift.frontend.lift import dense_parameter_bytes, lift
    from lightning_sparselift.passes import InfeasibleCandidate, select_passes
    from lightning_sparselift.plan.types import KernelBuild
    from lightning_sparselift.runtime import install
    from lightning_sparselift.session import mark_generated
    from lightning_sparselift.session.kernel_builds import buckets_asked

    dmp = sharded.dmp
    captured = gather_captures(capture.result())
    capture.remove()
    graph = lift(model, dmp.plan, sharded.sparse_module_paths, captured, dist.group.WORLD, device,
                 dense_parameter_bytes(dmp, sharded.sparse_module_paths))
    check_against_runtime(graph, model)
    # several ranks share the machine's 2 cores with one thread each: their buckets (forced on
    # here) run one after the other, which still checks every rank's partition; one rank runs
    # two threads and its buckets concurrently
    assert graph.threads_per_rank == [torch.get_num_threads()] * world
    graph.threads_per_rank = [2] * world
    installed = install(graph, model, dist.group.WORLD, device)
    if any(p.uses_generated_kernels for p in select_passes(list(optimizations))):
        # built before the run, as the session builds them: the one-bucket kernels, then the
        # kernels in buckets the passes ask for
        def built(local: list) -> None:
            builds: list = [None] * world
            dist.all_gather_object(builds, local)
            mark_generated(graph, [KernelBuild(rank=r, **b) for r, bs in enumerate(builds) for b in bs])

        built(installed.build_generated())
        built(installed.build_lookups(buckets_asked(select_passes(list(optimizations)), graph)))
    for optimization in select_passes(list(optimizations)):
        for candidate in optimization.candidates(graph):
            if candidate.feasible and optimization.only in (None, {candidate.role}):
                try:
                    graph = optimization.apply(graph, candidate)
                except InfeasibleCandidate:  # (what an earlier one applied, e.g. fewer tables than G)
                    continue
    installed.use(graph)
    return installed


def sharded_model(case: dict[str, Any], variant: dict[str, Any], world: int, device: torch.device) -> tuple[nn.Module, Any]:
    """The case's model from seed 0, sharded: (the model, ``shard_model``'s result)."""
    from lightning_sparselift.embedding_optimizer import EmbeddingOptimizer
    from lightning_sparselift.sharding import shard_model

    torch.manual_seed(0)
    model = ParityModel(variant["weighted"], variant["two_modules"], case.get("mean", ()), "sequence" in variant)
    tables = set(TABLES_A) | (set(TABLES_B) if variant["two_modules"] else set())
    sharding = {t: k for t, k in case["sharding"].items() if t in tables}
    return model, shard_model(model, world, device, sharding,
                              EmbeddingOptimizer(variant.get("optimizer", "rowwise_adagrad"), lr=0.1),
                              dist.group.WORLD, input_check_group=dist.group.WORLD)


def train(case: dict[str, Any], variant: dict[str, Any], lifted: bool, world: int,
          device: torch.device, optimizations: tuple[str, ...] = ()) -> dict[str, Any]:
    from lightning_sparselift.frontend.capture import SparseCapture

    model, sharded = sharded_model(case, variant, world, device)
    dmp = sharded.dmp
    dense_params = [p for n, p in dmp.named_parameters() if not hasattr(p, "_in_backward_optimizers")]
    dense_opt = torch.optim.SGD(dense_params, lr=0.05)
    rank = dist.get_rank()
    result: dict[str, Any] = {"outputs": [], "grads": [], "initial": local_state(dmp, dmp.fused_optimizer)}
    capture = SparseCapture(model, sharded.sparse_module_paths, rank, world) if lifted else None
    installed = None
    steps = batches(rank, variant, WARMUP_STEPS + LIFTED_STEPS)
    for step, batch in enumerate(steps):
        moved = tuple(x.to(device) if x is not None else None for x in batch)
        dense, labels, a, b = moved
        # announced as the loop would: the host batch the next step trains on (the executor moves it)
        next_batch = steps[step + 1] if step + 1 < len(steps) else None
        recorder = None
        if installed is not None:
            installed.announce(next_batch)
        if capture is not None and step < WARMUP_STEPS:
            context = capture.step(moved, next_batch)
            if step == WARMUP_STEPS - 1:  # the last captured step: what TorchRec issues, by module
                recorder = CollectiveRecorder({p: model.get_submodule(p) for p in sharded.sparse_module_paths})
        elif lifted and step == WARMUP_STEPS + 1:
            recorder = CollectiveRecorder()
            context = nullcontext()
        else:
            context = nullcontext()
        with context, (recorder if recorder is not None else nullcontext()):
            logits, pooled = dmp(dense, a, b) if b is not None else dmp(dense, a)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
            loss.backward()
        result["outputs"].append(pooled.detach().clone())
        result["grads"].append({n: p.grad.clone() for n, p in dmp.named_parameters() if p.grad is not None})
        dense_opt.step()
        dense_opt.zero_grad()
        if recorder is not None:
            result["captured_collectives" if step < WARMUP_STEPS else "lifted_collectives"] = recorder.records
        if capture is not None and step == WARMUP_STEPS - 1:
            installed = install_forced(model, sharded, capture, world, device, optimizations)
            result["graph"] = installed.graph.to_dict()
            result["explain"] = installed.graph.explain()
    result["final"] = local_state(dmp, dmp.fused_optimizer)
    if installed is not None:
        result["torchrec_steps"] = {p: f.torchrec_steps for p, f in installed.executors.items()}
        result["early_steps"] = {p: f.early_steps for p, f in installed.executors.items()}
        result["prefetched_steps"] = {p: f.prefetched_steps for p, f in installed.executors.items()}
        result["concatenated_steps"] = {p: f.concatenated_steps for p, f in installed.executors.items()}
        installed.discard()
    return result


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def worker(rank: int, world: int, port: int, cases: list[tuple[str, str, bool]], out_dir: str, cuda: bool = False
           ) -> None:
    """Per (case, variant, each pass alone too): its results in ``out_dir``, one file per rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(2 if world == 1 else 1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # a rank failing inside a case leaves the others in a collective: time out instead of hanging
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        for case_name, variant_name, each_pass in cases:
            try:
                res = {"reference": train(CASES[case_name], VARIANTS[variant_name], False, world, device),
                       "lifted": train(CASES[case_name], VARIANTS[variant_name], True, world, device),
                       **{name: train(CASES[case_name], VARIANTS[variant_name], True, world, device, passes)
                          for name, passes in optimized(variant_name, each_pass).items()}}
            except Exception:  # reported per case; every rank fails the same way or the test times out
                res = {"error": traceback.format_exc()}
            torch.save(_to_cpu(res), os.path.join(out_dir, f"{case_name}-{variant_name}-rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()
