"""Bad input gets a clear error, before any collective can hang on it: the input checks, the
NaN warning and the strategy's option checks (under Trainer.fit: tests/ranks/test_inputs_fit.py)."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from helpers import tiny_data, tiny_model
from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.validation import SparseInputError, check_kjt, kjt_problem

ROWS = {"a": 10, "b": 5}


def _kjt(keys, values, lengths):
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor(values, dtype=torch.long),
                                               lengths=torch.tensor(lengths, dtype=torch.int32))


def test_valid_kjt_passes():
    check_kjt("ebc", _kjt(["a", "b"], [0, 9, 4], [1, 1, 1, 0]), ROWS)
    check_kjt("ebc", _kjt(["b", "a"], [], [0, 0]), ROWS)


@pytest.mark.parametrize("keys, match", [(["a"], r"missing \['b'\]"), (["a", "a", "b"], r"duplicated \['a'\]")])
def test_wrong_keys(keys, match):
    with pytest.raises(SparseInputError, match=match):
        check_kjt("ebc", _kjt(keys, [0] * len(keys), [1] * len(keys)), ROWS)


def test_keys_of_another_collection_pass_and_their_ids_are_left_to_it():
    # 'c' belongs to another module (ids beyond this one's tables); 'b' is still checked
    check_kjt("ebc", _kjt(["c", "a", "b"], [123456, -1, 0, 4], [2, 1, 1]), ROWS)
    with pytest.raises(SparseInputError, match=r"id 5 of feature 'b'"):
        check_kjt("ebc", _kjt(["c", "a", "b"], [123456, 0, 5], [1, 1, 1]), ROWS)


def test_bags_of_one_id_where_the_lookup_pools():
    # 'b' read by a data-parallel EmbeddingCollection table on CPU: a bag of two ids (or none) is refused
    check_kjt("ec", _kjt(["a", "b"], [0, 9, 4, 3], [2, 0, 1, 1]), ROWS, single_id=frozenset({"b"}))
    for lengths in ([1, 1, 2, 0], [1, 1, 0, 2]):
        with pytest.raises(SparseInputError, match=r"feature 'b' has bags of 0-2 ids.*data-parallel table of an "
                                                   r"EmbeddingCollection on CPU"):
            check_kjt("ec", _kjt(["a", "b"], [0, 1, 2, 3], lengths), ROWS, single_id=frozenset({"b"}))


def _vbe(values):
    # 'a' for 1 sample, 'b' for 3 (a variable batch per feature), ids [a | b b b]
    return KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor(values), lengths=torch.tensor([1, 1, 1, 1]),
                             stride_per_key_per_rank=[[1], [3]],
                             inverse_indices=(["a", "b"], torch.tensor([[0, 0, 0], [0, 1, 2]])))


def test_a_variable_batch_per_feature_is_checked_per_key():
    check_kjt("ebc", _vbe([9, 0, 1, 4]), ROWS)
    with pytest.raises(SparseInputError, match=r"id 9 of feature 'b'"):  # 9 fits 'a' (10 rows), not 'b' (5)
        check_kjt("ebc", _vbe([0, 9, 1, 4]), ROWS)
    assert "data-parallel lookup does not take on CPU" in kjt_problem(_vbe([9, 0, 1, 4]), ROWS, variable_batch_ok=False)


def test_malformed_kjts():
    with pytest.raises(SparseInputError, match=r"ids are torch.float32, expected int32 or int64"):
        check_kjt("ebc", KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([]), lengths=torch.zeros(2).int()), ROWS)
    with pytest.raises(SparseInputError, match=r"lengths add up to 3 but it holds 2 ids"):
        check_kjt("ebc", KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([0, 1]),
                                           lengths=torch.tensor([2, 1], dtype=torch.int32)), ROWS)
    with pytest.raises(SparseInputError, match=r"3 lengths for 2 keys"):
        check_kjt("ebc", KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([0, 1, 2]),
                                           lengths=torch.ones(3, dtype=torch.int32)), ROWS)


def test_a_weighted_module_needs_weights():
    """TorchRec would pool the ids of a weighted collection without weights, silently unweighted."""
    with pytest.raises(SparseInputError, match=r"ebc: the module is weighted .* has no weights"):
        check_kjt("ebc", _kjt(["a", "b"], [0, 4], [1, 1]), ROWS, weighted=True)
    weighted = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.tensor([0, 4]),
                                                   lengths=torch.tensor([1, 1], dtype=torch.int32),
                                                   weights=torch.tensor([0.5, 2.0]))
    check_kjt("ebc", weighted, ROWS, weighted=True)
    check_kjt("ebc", weighted, ROWS)  # (an unweighted module ignores weights, as TorchRec's does)


@pytest.mark.parametrize("values, match", [([0, 5], r"id 5 of feature 'b'.*\[0, 5\)"),
                                           ([-1, 0], r"id -1 of feature 'a'.*\[0, 10\)")])
def test_ids_out_of_range(values, match):
    with pytest.raises(SparseInputError, match=match):
        check_kjt("ebc", _kjt(["a", "b"], values, [1, 1]), ROWS)


def test_nan_dense_features_warn(data_cache):
    dm = tiny_data(data_cache)
    dm.setup("fit")
    model = tiny_model(dm)
    batch = dm.train_dataloader().dataset[0]
    batch.dense[0, 0] = float("nan")
    from torch.nn import Identity

    model.model = Identity()  # the warning is raised before the model runs
    model.forward = lambda b: torch.zeros(len(b))
    with pytest.warns(RuntimeWarning, match="NaN value"):
        model.training_step(batch, 0)


def test_unknown_options_and_names():
    with pytest.raises(TypeError):
        SparseLiftStrategy(not_an_option=1)
    with pytest.raises(ValueError, match="executor"):
        SparseLiftStrategy(executor="fast")
    with pytest.raises(ValueError, match="capture_steps must be >= 1"):
        SparseLiftStrategy(executor="sparselift", capture_steps=0)
    SparseLiftStrategy(executor="torchrec", capture_steps=0)
    with pytest.deprecated_call(match="capture_steps"):  # the old name still works
        assert SparseLiftStrategy(warmup_batches=5).session_options.capture_steps == 5
    with pytest.raises(ValueError, match="unknown optimization"):
        SparseLiftStrategy(optimizations=["aggregation", "teleportation"])
    with pytest.raises(ValueError, match="unknown embedding optimizer"):
        SparseLiftStrategy(embedding_optimizer="lamb")
    with pytest.raises(ValueError, match="unknown embedding_optimizer option"):
        SparseLiftStrategy(embedding_optimizer={"name": "sgd", "momentum": 0.9})
    with pytest.raises(ValueError, match="start_method"):
        SparseLiftStrategy(start_method="thread")
    with pytest.raises(ValueError, match="workspace_budget_mb must be >= 0"):
        SparseLiftStrategy(workspace_budget_mb=-1)
    assert SparseLiftStrategy(workspace_budget_mb=1.5).session_options.workspace_budget_bytes == 1572864
    with pytest.raises(ValueError, match="numerics must be one of"):
        SparseLiftStrategy(numerics="approximate")
    assert SparseLiftStrategy(numerics="fast").session_options.numerics == "fast"


def test_input_check_skips_only_what_it_checked_unchanged(monkeypatch):
    from torch import nn

    from lightning_sparselift import validation

    calls = []
    monkeypatch.setattr(validation, "check_kjt", lambda path, kjt, *rest: calls.append(kjt) or check_kjt(path, kjt, *rest))
    hook, module = validation.InputCheck("ebc", ROWS, None), nn.Module()
    kjt = _kjt(["a", "b"], [0, 4], [1, 1])
    hook(module, (kjt,), {})
    hook(module, (kjt,), {})  # the executor's early start, then the module's call: checked once
    assert len(calls) == 1
    hook(module, (_kjt(["a", "b"], [0, 4], [1, 1]),), {})  # equal, but other tensors: checked
    assert len(calls) == 2
    kjt.values()[1] = 5  # changed in place since its check (a reused buffer): checked again
    with pytest.raises(SparseInputError, match="id 5 of feature 'b'"):
        hook(module, (kjt,), {})
