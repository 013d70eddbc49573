"""Sharding plans TorchRec cannot make fail naming the tables and the option to change, on meta
models in one process."""

import pytest
import torch

from lightning_sparselift.sharding import build_sharding_plan, sharder_for


def _model(**tables: tuple[int, int]) -> torch.nn.Module:
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    model = torch.nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{name}"])
        for name, (rows, dim) in tables.items()], device=torch.device("meta"))
    return model


def test_a_column_wise_table_whose_columns_do_not_split_over_the_ranks_is_named():
    model = _model(t=(100, 8), u=(100, 8))
    with pytest.raises(ValueError, match=r"table 't' \(embedding_dim 8\): sharding type 'column_wise'.*over the 3 "
                                         r"ranks.*pin another type for it in sharding_types"):
        build_sharding_plan(model, [sharder_for(model.ebc)], 3, "cpu", {"t": "column_wise", "u": "row_wise"}, None)


def test_no_plan_from_torchrecs_planner_names_the_tables_and_the_option():
    model = _model(huge=(10**10, 128))
    with pytest.raises(ValueError, match=r"(?s)TorchRec's planner found no sharding plan for the tables \['huge'\] on 2 "
                                         r"cpu rank\(s\) \(no sharding_types\): Unable to find a plan.*"
                                         r"SparseLiftStrategy\(sharding_types="):
        build_sharding_plan(model, [sharder_for(model.ebc)], 2, "cpu", {}, None)


def test_qcomms_config_must_be_torchrecs():
    from lightning_sparselift.sharding import quantized_comms

    with pytest.raises(TypeError, match="qcomms_config takes TorchRec's QCommsConfig"):
        quantized_comms({"forward_precision": "fp16"}, torch.device("cpu"))
