"""Which tables the strategy copies into their shards: those a model built with values, said once
with the memory they took; tables on meta (the recommended way) are left to their configs."""

import pytest
import torch

from lightning_sparselift.initial_tables import built_tables


def _collection(device):
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=1024,
                                                             feature_names=["f"])], device=device)


def test_tables_built_with_values_are_kept_and_named():
    ebc = _collection(torch.device("cpu"))
    with pytest.warns(RuntimeWarning, match=r"1 table\(s\) were built on cpu instead of the meta device "
                                            r"\(embedding_bags.t.weight\).*every full table \(0.0 MB\)"):
        values = built_tables(ebc, list(ebc.parameters()))
    assert list(values) == ["embedding_bags.t.weight"] and values["embedding_bags.t.weight"].shape == (1024, 4)


def test_tables_on_meta_are_left_to_their_configs(recwarn):
    ebc = _collection(torch.device("meta"))
    assert built_tables(ebc, list(ebc.parameters())) == {}
    assert not [w for w in recwarn if "built on" in str(w.message)]
