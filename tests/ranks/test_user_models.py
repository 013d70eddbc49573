"""Users' own LightningModules (tests/user_models.py: the KJT passed positionally, inside a dict,
inside a dataclass, as a keyword argument) train through the lifted executor bit-identically to
TorchRec's path, with every pass forced on and with the default calibration."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as L
import pytest

from helpers import (
    LIFTED, DumpLocalState, ExecutorReport, GraphReport, assert_calibration_finished, assert_same_dumps, load_dumps,
    tiny_data, trainer,
)
from lightning_sparselift import SparseLiftStrategy
from user_models import MODELS


def _fit(name: str, dm, folder: Path, **strategy_kwargs) -> list[dict]:
    L.seed_everything(0)
    model = MODELS[name](dm.table_sizes, dm.feature_names)
    strategy = SparseLiftStrategy(start_method="fork", embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                  **strategy_kwargs)
    t = trainer(2, strategy, limit_val_batches=0,
                callbacks=[DumpLocalState(folder), ExecutorReport(folder), GraphReport(folder)])
    t.fit(model, dm)
    return [json.loads((folder / f"report{r}.json").read_text()) for r in range(2)]


def _assert_identical(reference: Path, lifted: Path, world: int = 2) -> None:
    states = assert_same_dumps(reference, lifted, world)
    assert all(any(k.startswith("optim/") for k in state) for state in states), "no fused optimizer state found"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_user_model_with_every_pass_forced_on_matches_torchrec(name, tmp_path, data_cache):
    dm = tiny_data(data_cache, num_train=640)
    _fit(name, dm, tmp_path / "torchrec", executor="torchrec")
    reports = _fit(name, dm, tmp_path / "lifted", calibrate=False)
    for report in reports:
        assert report["executor"] in LIFTED, report["fallback"]
        accepted = {c for c, ok, _ in report["decisions"] if ok}
        assert {"latency_hiding:early_start@embeddings", "latency_hiding:next_batch@embeddings"} <= accepted
        # steps 0-2 are captured; every later one starts early (and all but the first is prefetched)
        assert report["early_steps"] == 10 - 3 and report["prefetched_steps"] == 10 - 4
        # (what keeps_outputs holds is never handed out again: it checks its kept outputs every step)
        assert report["buffers_reused"] > 0
    _assert_identical(tmp_path / "torchrec", tmp_path / "lifted")


# Each candidate measures at most 64 pairs here (the default confidence, a smaller pair budget than the
# default 256, so that the step count does not hang on how many candidates the passes offer):
# 2 * (1 warmup + 64) pairs * (1 + settle steps) = 130 steps at most, 260 for next batch (1 settle step).
PAIRS, STEPS_PER_CANDIDATE = 64, 2 * (1 + 64)
CALIBRATED_STEPS = 1100


@pytest.mark.slow  # (1,100 steps; make test calibrates to the end with a one-look budget: ranks/test_lifting.py)
def test_user_model_with_default_calibration_matches_torchrec(tmp_path, data_cache):
    dm = tiny_data(data_cache, num_train=CALIBRATED_STEPS * 64)
    _fit("positional", dm, tmp_path / "torchrec", executor="torchrec")
    reports = _fit("positional", dm, tmp_path / "lifted", calibration_max_pairs=PAIRS)
    for report in reports:
        assert report["executor"] in LIFTED, report["fallback"]
        assert report["decisions"] is not None, f"calibration did not finish in {CALIBRATED_STEPS} steps"
        candidates = {c for c, _, _ in report["decisions"]}
        assert {"latency_hiding:early_start@embeddings", "latency_hiding:next_batch@embeddings"} <= candidates
        assert_calibration_finished(report["left"])  # (a candidate the round's budget left is decided enough)
        # 3 captured steps, every candidate at its worst, the 40-step check: fails as soon as the passes
        # offer more candidates than the steps cover, not only when a noisy run needs every pair
        worst = 3 + STEPS_PER_CANDIDATE * (len(report["measured"]) + 1) + 40
        assert worst <= CALIBRATED_STEPS, report["measured"]
    _assert_identical(tmp_path / "torchrec", tmp_path / "lifted")


# (TorchRec collection, sharding type of its tables) -> the user model holding one next to a plain
# EmbeddingBagCollection (tests/support_table.py renders the table of docs/models.md from this)
OTHER_COLLECTIONS = {**{(collection, sharding): kind
                        for collection, kind in (("EmbeddingCollection", "sequence"),
                                                 ("FeatureProcessedEmbeddingBagCollection", "positioned"))
                        for sharding in ("table_wise", "row_wise", "column_wise", "data_parallel")},
                     # (TorchRec's sharder of an EmbeddingCollection offers no table-row-wise)
                     ("FeatureProcessedEmbeddingBagCollection", "table_row_wise"): "positioned"}
# the ones the lifted executor runs (the others keep TorchRec's path)
LIFTED_COLLECTIONS = ("EmbeddingCollection",)


@pytest.mark.parametrize("collection, sharding", sorted(OTHER_COLLECTIONS))
def test_a_model_with_other_torchrec_collections_is_sharded_and_lifted_per_module(collection, sharding, tmp_path,
                                                                                data_cache):
    from user_models import WithPositionWeights, WithSequenceFeature

    dm = tiny_data(data_cache, num_train=640)
    kind = OTHER_COLLECTIONS[(collection, sharding)]
    model = {"sequence": WithSequenceFeature, "positioned": WithPositionWeights}[kind]
    tables = [f"seq_{dm.feature_names[0]}"] if kind == "sequence" else [f"table_{f}" for f in dm.feature_names[:2]]
    types = {t: sharding for t in tables}
    sharded_type = f"Sharded{collection}"

    def fit(folder: Path, **kwargs) -> SparseLiftStrategy:
        L.seed_everything(0)
        strategy = SparseLiftStrategy(start_method="fork", sharding_types=types, calibrate=False,
                                      embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05}, **kwargs)
        t = trainer(2, strategy, limit_val_batches=0, callbacks=[DumpLocalState(folder), GraphReport(folder)])
        t.fit(model(dm.table_sizes, dm.feature_names), dm)
        report = json.loads((folder / "graph0.json").read_text())
        assert {report["plan"][kind][t] for t in tables} == {sharding}
        return report

    fit(tmp_path / "torchrec", executor="torchrec")
    report = fit(tmp_path / "lifted")
    if collection in LIFTED_COLLECTIONS:
        assert report["modules"] == [kind, "embeddings"] and report["not_lifted"] == {}
    else:  # it keeps TorchRec's path (with the reason), the plain bags are lifted
        assert report["modules"] == ["embeddings"]
        assert list(report["not_lifted"]) == [kind]
        assert f"{sharded_type} is not a plain ShardedEmbeddingBagCollection" in report["not_lifted"][kind]
        assert f"module {kind}: not lifted, TorchRec's path" in report["explain"]
    assert any(k.startswith(f"{kind}.") for state in load_dumps(tmp_path / "lifted", 2) for k in state)
    _assert_identical(tmp_path / "torchrec", tmp_path / "lifted")


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise", "data_parallel"])
def test_a_model_with_every_collection_kind_on_one_kjt_is_sharded_and_lifted_per_module(sharding, world, tmp_path,
                                                                                        data_cache):
    from user_models import WithEveryCollection

    dm = tiny_data(data_cache, num_train=960)
    first, weighted = dm.feature_names[0], dm.feature_names[1:3]
    types = {f"seq_{first}": sharding, **{f"table_{f}": sharding for f in weighted}}

    def fit(folder: Path, **kwargs) -> dict:
        L.seed_everything(0)
        strategy = SparseLiftStrategy(start_method="fork", sharding_types=types, calibrate=False,
                                      embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05}, **kwargs)
        t = trainer(world, strategy, limit_val_batches=0,
                    callbacks=[DumpLocalState(folder), ExecutorReport(folder), GraphReport(folder)])
        t.fit(WithEveryCollection(dm.table_sizes, dm.feature_names), dm)
        graph = json.loads((folder / "graph0.json").read_text())
        assert {graph["plan"][m][t] for m in ("sequence", "positioned") for t in graph["plan"][m]} == {sharding}
        return {**graph, **json.loads((folder / "report0.json").read_text())}

    fit(tmp_path / "torchrec", executor="torchrec")
    report = fit(tmp_path / "lifted")
    assert report["executor"] in LIFTED and report["modules"] == ["sequence", "embeddings"]
    assert sorted(report["not_lifted"]) == ["positioned"]
    # the lifted collections read the batch's KJT as it is: they start early and prefetch the next batch
    assert report["early_steps"] > 0 and report["prefetched_steps"] > 0
    _assert_identical(tmp_path / "torchrec", tmp_path / "lifted", world)


MANAGED_COLLECTIONS = {("ManagedCollisionEmbeddingBagCollection", "row_wise"): "WithManagedCollisions",
                       ("ManagedCollisionEmbeddingCollection", "row_wise"): "WithManagedSequence"}


@pytest.mark.parametrize("collection, sharding", sorted(MANAGED_COLLECTIONS))
def test_a_managed_collision_collection_is_sharded_row_wise_and_trains_like_torchrec(collection, sharding, tmp_path,
                                                                                     data_cache):
    import user_models

    dm = tiny_data(data_cache, num_train=640)
    model = getattr(user_models, MANAGED_COLLECTIONS[(collection, sharding)])

    def fit(folder: Path, **kwargs) -> dict:
        L.seed_everything(0)
        # (Adagrad: fbgemm resets evicted rows' row-wise Adagrad state on CUDA only)
        strategy = SparseLiftStrategy(start_method="fork", calibrate=False,
                                      embedding_optimizer={"name": "adagrad", "lr": 0.05}, **kwargs)
        t = trainer(2, strategy, limit_val_batches=0, callbacks=[DumpLocalState(folder), GraphReport(folder)])
        t.fit(model(dm.table_sizes, dm.feature_names), dm)  # raw ids up to 2^20 pass the input checks
        report = json.loads((folder / "graph0.json").read_text())
        assert report["plan"]["managed"] == {f"mc_{dm.feature_names[0]}": sharding}  # row-wise without asking
        return report

    fit(tmp_path / "torchrec", executor="torchrec")
    report = fit(tmp_path / "lifted")
    assert report["modules"] == ["embeddings"]
    assert f"Sharded{collection} is not a plain" in report["not_lifted"]["managed"]
    states = assert_same_dumps(tmp_path / "torchrec", tmp_path / "lifted")
    assert any("_mch_remapped_ids_mapping" in k for k in states[0])


@pytest.mark.parametrize("option, message", [
    (dict(embedding_optimizer="rowwise_adagrad"),
     r"managed-collision collection\(s\) \['managed'\] with the rowwise_adagrad embedding optimizer on CPU"),
    (dict(embedding_optimizer="sgd", sharding_types={"mc_cat_0": "table_wise"}),
     r"sharding type 'table_wise' \(table 'mc_cat_0'\): TorchRec's sharder of the module 'managed' offers "
     r"\['row_wise'\]"),
])
def test_unsupported_managed_collision_settings_are_refused_by_name(option, message, data_cache):
    from user_models import WithManagedCollisions

    dm = tiny_data(data_cache, num_train=640)
    t = trainer(2, SparseLiftStrategy(start_method="fork", **option), limit_val_batches=0)
    with pytest.raises(Exception, match=message):
        t.fit(WithManagedCollisions(dm.table_sizes, dm.feature_names), dm)


def test_a_sharding_type_the_modules_sharder_does_not_offer_is_refused_by_name(data_cache):
    from user_models import WithSequenceFeature

    dm = tiny_data(data_cache, num_train=640)
    table = f"seq_{dm.feature_names[0]}"
    t = trainer(1, SparseLiftStrategy(start_method="fork", sharding_types={table: "table_row_wise"}),
                limit_val_batches=0)
    with pytest.raises(Exception, match=rf"sharding type 'table_row_wise' \(table '{table}'\): TorchRec's sharder of "
                                        rf"the module 'sequence' offers \['data_parallel', 'table_wise', "):
        t.fit(WithSequenceFeature(dm.table_sizes, dm.feature_names), dm)


VARIABLE_BATCH = ("table_wise", "row_wise", "column_wise")


@pytest.mark.parametrize("sharding", [*VARIABLE_BATCH, "data_parallel"])
def test_a_variable_batch_per_feature_trains_on_torchrecs_path(sharding, tmp_path, data_cache):
    from user_models import WithVariableBatch

    dm = tiny_data(data_cache, num_train=640)

    def fit(folder: Path, **kwargs) -> dict:
        L.seed_everything(0)
        strategy = SparseLiftStrategy(start_method="fork", calibrate=False,
                                      sharding_types={f"table_{f}": sharding for f in dm.feature_names},
                                      embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05}, **kwargs)
        t = trainer(2, strategy, limit_val_batches=0, callbacks=[DumpLocalState(folder), ExecutorReport(folder)])
        t.fit(WithVariableBatch(dm.table_sizes, dm.feature_names), dm)
        return json.loads((folder / "report0.json").read_text())

    if sharding == "data_parallel":  # TorchRec's data-parallel lookup reads a VBE batch wrong on CPU: refused
        with pytest.raises(Exception, match=r"embeddings: .*variable batch per feature \(VBE\), which TorchRec's "
                                            r"data-parallel lookup does not take on CPU"):
            fit(tmp_path / "torchrec", executor="torchrec")
        return
    fit(tmp_path / "torchrec", executor="torchrec")
    report = fit(tmp_path / "lifted")
    # the lifted executor takes no VBE: the module keeps TorchRec's path, saying why
    assert report["executor"] == "torchrec" and "variable batch size per feature (VBE)" in report["fallback"]
    _assert_identical(tmp_path / "torchrec", tmp_path / "lifted")


def _fit_two_bag_collections(dm, folder: Path, **strategy_kwargs) -> dict:
    """Trainer.fit of tests/user_models.py's TwoBagCollections on 2 ranks, every pass applied;
    rank 0's graph report."""
    from user_models import TwoBagCollections

    L.seed_everything(0)
    strategy = SparseLiftStrategy(start_method="fork", calibrate=False,
                                  embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05}, **strategy_kwargs)
    t = trainer(2, strategy, limit_val_batches=0, callbacks=[DumpLocalState(folder), GraphReport(folder)])
    t.fit(TwoBagCollections(dm.table_sizes, dm.feature_names), dm)
    return json.loads((folder / "graph0.json").read_text())


def test_a_module_whose_capture_fails_keeps_torchrecs_path_and_the_others_are_lifted(tmp_path, data_cache,
                                                                                    monkeypatch):
    from lightning_sparselift.frontend.capture import SparseCapture

    observe = SparseCapture._observe

    def failing_second(self, path, kjt):  # (forked ranks inherit the patch: every rank's capture fails alike)
        observe(self, path, kjt)
        if path == "second":
            self._inputs[path] = {"error": "second: injected capture failure"}

    monkeypatch.setattr(SparseCapture, "_observe", failing_second)
    dm = tiny_data(data_cache, num_train=640)
    _fit_two_bag_collections(dm, tmp_path / "torchrec", executor="torchrec")
    report = _fit_two_bag_collections(dm, tmp_path / "lifted")
    assert report["modules"] == ["embeddings"]
    assert report["not_lifted"] == {"second": "second: injected capture failure"}
    _assert_identical(tmp_path / "torchrec", tmp_path / "lifted")


def test_table_row_wise_over_two_hosts_keeps_torchrecs_path_for_that_module(tmp_path, data_cache, monkeypatch):
    """One rank per host (LOCAL_WORLD_SIZE=1): TorchRec's table-row-wise exchanges run across hosts
    (staggered), which the lifted executor does not run; a module with nothing but such tables
    keeps TorchRec's path, the other is lifted, bit-identical."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # (forked ranks inherit it; TorchRec reads it)
    dm = tiny_data(data_cache, num_train=640)
    second = {f"table_{f}": "table_row_wise" for f in dm.feature_names[3:]}
    _fit_two_bag_collections(dm, tmp_path / "torchrec", executor="torchrec", sharding_types=second)
    report = _fit_two_bag_collections(dm, tmp_path / "lifted", sharding_types=second)
    assert set(report["plan"]["second"].values()) == {"table_row_wise"}
    assert report["modules"] == ["embeddings"] and list(report["not_lifted"]) == ["second"]
    assert "span 2 hosts of 1 ranks" in report["not_lifted"]["second"]
    _assert_identical(tmp_path / "torchrec", tmp_path / "lifted")


# over several hosts: the sharding types of the first tables of one module (the group of the first
# keeps TorchRec's path, the rest table-wise; tests/support_table.py renders them)
SEVERAL_HOSTS = ("table_row_wise", "row_wise", "data_parallel")


def test_a_group_that_cannot_be_lifted_keeps_torchrecs_path_and_the_modules_other_groups_are_lifted(
        tmp_path, data_cache, monkeypatch):
    """Over two hosts (one rank each) a table-row-wise group keeps TorchRec's path inside the lifted
    module: TorchRec's own input dist, lookup and output dist of that group run in the executor's
    step, with early start and the next batch's input dist applied, while the module's row-wise,
    table-wise and data-parallel groups run lifted (aggregated, generated kernels): bit-identical."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    dm = tiny_data(data_cache, num_train=640)
    f = dm.feature_names
    types = {f"table_{name}": kind for name, kind in zip(f, SEVERAL_HOSTS)}
    _fit("positional", dm, tmp_path / "torchrec", executor="torchrec", sharding_types=types)
    reports = _fit("positional", dm, tmp_path / "lifted", calibrate=False, sharding_types=types)
    graph = json.loads((tmp_path / "lifted" / "graph0.json").read_text())
    assert graph["modules"] == ["embeddings"] and graph["not_lifted"] == {}
    assert "runs TorchRec's input dist, lookup and output dist of the group: table_row_wise tables " \
           f"['table_{f[0]}'] span 2 hosts of 1 ranks" in graph["explain"]
    for report in reports:
        assert report["executor"] in LIFTED, report["fallback"]
        accepted = {c for c, ok, _ in report["decisions"] if ok}
        assert {"latency_hiding:early_start@embeddings", "latency_hiding:next_batch@embeddings",
                "aggregation:input@embeddings", "codegen:lookup@embeddings"} <= accepted, accepted
        assert report["early_steps"] == 10 - 3 and report["prefetched_steps"] == 10 - 4
    _assert_identical(tmp_path / "torchrec", tmp_path / "lifted")
