"""A bench scenario's optimizers overridden for one run (``sparselift bench --optimizer``)."""

import pytest

from lightning_sparselift.bench import scenarios
from lightning_sparselift.bench.runner import BenchConfig


def test_overrides_replace_only_the_keys_given_and_reach_the_model_and_the_tables():
    dlrm = scenarios.load("dlrm")
    changed = dlrm.with_optimizer(scenarios.parse_optimizer("embedding=rowwise_adagrad, embedding_lr=0.05,dense=adagrad"))
    assert changed.optimizer == {"dense": "adagrad", "dense_lr": 0.1, "embedding": "rowwise_adagrad",
                                 "embedding_lr": 0.05}
    assert dlrm.optimizer["embedding"] == "sgd"  # the loaded scenario is not modified
    assert changed.embedding_optimizer() == {"name": "rowwise_adagrad", "lr": 0.05}
    assert changed.module().dense_optimizer == "adagrad"
    config = BenchConfig(scenario="dlrm", optimizer={"embedding": "adam"})
    assert config.load_scenario().embedding_optimizer()["name"] == "adam"
    assert BenchConfig(scenario="dlrm").load_scenario() == dlrm
    assert scenarios.parse_optimizer("") == {}


@pytest.mark.parametrize("overrides, message", [
    ({"momentum": 0.9}, r"unknown optimizer key\(s\) \['momentum'\]"),
    ({"dense": "lbfgs"}, r"optimizer dense='lbfgs': one of \['adagrad', 'adam', 'adamw', 'sgd'\]"),
    ({"embedding_lr": -1.0}, r"optimizer embedding_lr=-1.0: a learning rate > 0"),
])
def test_bad_overrides_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        scenarios.load("tiny").with_optimizer(overrides)
