"""The sequence model family: target attention, the generator of item histories and the module's
checks (training through the strategy and the LightningCLI config:
tests/ranks/test_sequence_model_fit.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_sparselift.data.sequence import SequenceSpec, generate_sequences
from lightning_sparselift.models import SequenceRankingModule
from lightning_sparselift.models.sequence import target_attention


def test_target_attention_matches_a_per_sample_softmax_and_gives_zeros_for_empty_histories():
    torch.manual_seed(0)
    lengths = torch.tensor([3, 0, 1, 5], dtype=torch.int32)
    query = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    history = torch.randn(int(lengths.sum()), 6, dtype=torch.float64, requires_grad=True)
    got = target_attention(query, history, lengths)
    rows = history.split(lengths.tolist())
    want = torch.stack([torch.softmax(h @ q / 6 ** 0.5, dim=0) @ h if len(h) else torch.zeros(6, dtype=torch.float64)
                        for q, h in zip(query, rows)])
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], torch.zeros(6, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda q, h: target_attention(q, h, lengths), (query, history))
    with pytest.raises(ValueError, match="4 queries .* for 3 histories"):
        target_attention(query, history, lengths[:3])


def _spec(**kwargs) -> SequenceSpec:
    args = dict(num_samples=4000, categorical_rows=(40, 300), num_items=500, categories=10, mean_history=6,
                max_history=20, seed=1)
    args.update(kwargs)
    return SequenceSpec(**args)


def test_histories_have_variable_capped_lengths_and_carry_the_planted_signal():
    a = generate_sequences(_spec())
    assert np.array_equal(a["values"], generate_sequences(_spec())["values"])  # deterministic
    history = a["lengths"][2]
    assert (history == 0).any() and history.max() == 20 and abs(history.mean() - 6) < 1.0
    assert (a["lengths"][[0, 1, 3]] == 1).all()  # one-hot categorical features and one target item
    ids = np.split(a["values"], np.cumsum(a["lengths"].sum(axis=1))[:-1])
    assert ids[0].max() < 40 and ids[1].max() < 300 and ids[2].max() < 500 and ids[3].max() < 500
    # the label depends on the target's category among the history's: informative, not trivially so
    from lightning_sparselift.data.synthetic import bayes_optimal_auc

    assert 0.7 < bayes_optimal_auc(a["probability"], a["labels"]) < 0.95
    assert np.ptp(generate_sequences(_spec(signal_strength=0.0))["probability"]) == 0  # labels independent
    with pytest.raises(ValueError, match="num_items"):
        _spec(num_items=5)
    with pytest.raises(ValueError, match="mean_history"):
        _spec(mean_history=30)


@pytest.mark.parametrize("change, message", [
    (dict(feature_names=["cat_0", "cat_1", "history", "target"]), r"\['item'\] not among the features"),
    (dict(num_embeddings_per_feature=[40, 300, 500, 400]), "share the item table: their rows differ"),
    (dict(feature_names=["history", "item"], num_embeddings_per_feature=[500, 500]), "at least one categorical"),
    (dict(over_arch_layer_sizes=[16, 2]), "ending in 1"),
])
def test_the_module_names_what_is_wrong(change, message):
    args = dict(num_embeddings_per_feature=[40, 300, 500, 500], feature_names=["cat_0", "cat_1", "history", "item"])
    args.update(change)
    with pytest.raises(ValueError, match=message):
        SequenceRankingModule(**args)
