"""Concurrent buckets through Trainer.fit (a spawned process of its own): one rank with two intra-op
threads runs a user model's lookups in buckets, bit-identical to TorchRec's path. The pass on
small graphs: tests/unit/test_subgraph_parallelism.py."""

from __future__ import annotations


def _fit_one_rank_two_threads(folder: str, data_cache: str) -> None:
    """Both executors' fits, in a process of their own (a fit in the test process would leave its
    process group, Lightning's environment variables and a used OpenMP pool to the later tests'
    forked ranks)."""
    from pathlib import Path

    import lightning.pytorch as L
    import torch

    from helpers import DumpLocalState, tiny_data, trainer
    from lightning_sparselift import SparseLiftStrategy
    from user_models import TwoBagCollections

    torch.set_num_threads(2)
    dm = tiny_data(Path(data_cache), num_train=640)
    for executor in ("torchrec", "sparselift"):
        L.seed_everything(0)
        strategy = SparseLiftStrategy(executor=executor, calibrate=False, sharding_types={
            f"table_{f}": "table_wise" for f in dm.feature_names}, optimizations=["codegen", "subgraph_parallelism"],
            embedding_optimizer={"name": "sgd", "lr": 0.05})
        trainer(1, strategy, limit_val_batches=0, callbacks=[DumpLocalState(Path(folder) / executor)]).fit(
            TwoBagCollections(dm.table_sizes, dm.feature_names), dm)
        if executor == "sparselift":
            strategy.execution_plan.save(Path(folder) / "plan.json")


def test_one_rank_with_two_threads_trains_a_user_model_in_buckets_bit_identical_to_torchrec(tmp_path, data_cache):
    """Trainer.fit on one rank running two intra-op threads, a user's model with two
    EmbeddingBagCollections, buckets applied without calibration: the same tables, fused optimizer
    state and dense weights as TorchRec's path, and the plan records the bucketed kernels."""
    import multiprocessing as mp

    from helpers import assert_same_dumps
    from lightning_sparselift.plan import ExecutionPlan

    child = mp.get_context("spawn").Process(target=_fit_one_rank_two_threads, args=(str(tmp_path), str(data_cache)))
    child.start()
    child.join(timeout=300)
    assert child.exitcode == 0
    assert_same_dumps(tmp_path / "torchrec", tmp_path / "sparselift", world_size=1)
    plan = ExecutionPlan.load(tmp_path / "plan.json")
    assert plan.graph.threads_per_rank == [2]
    buckets = {m.path: len(m.schedule.region("lookup", 0).buckets) for m in plan.graph.modules}
    assert buckets == {"embeddings": 3, "second": 3}  # three tables each: G = 4 and 8 make three buckets
    # every rung's kernels are built before a round without calibration applies its buckets (G = 4
    # and 8 make the same three buckets: one kernel)
    assert sorted((b.module, b.buckets) for b in plan.kernel_builds if b.buckets > 1) == [
        ("embeddings", 2), ("embeddings", 3), ("second", 2), ("second", 3)]
    assert "in buckets" in plan.explain()
