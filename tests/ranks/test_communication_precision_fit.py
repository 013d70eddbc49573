"""numerics='fast': the communication-precision pass sends the output all-to-alls' values as BF16
both ways, with every other pass forced on (aggregation merges the table- and column-wise
exchanges: the cast fused into the packing copy; the consumer layout; early start), pooled and an
EmbeddingCollection's rows; gloo exchanges BF16 on CPU. That the cast is TorchRec's BF16 codec bit
for bit is the unit tests' (``tests/unit/test_communication_precision.py``): a run cannot be
compared with TorchRec's path under that codec bit for bit, since the capture steps run TorchRec's
path in float32 here. Under the default numerics nothing is cast (the other tests' parity)."""

from __future__ import annotations

import re

import pytest
import torch

from helpers import LIFTED, assert_same_dumps, load_dumps, tiny_data
from test_qcomms_fit import _fit
from user_models import WithSequenceFeature

TW_CW = {"table_cat_4": "column_wise"}  # (no row-wise table: its reduce-scatter stays float32 under the pass)


@pytest.mark.parametrize("model, sharding_types, role, module", [(None, TW_CW, "pooled", "embeddings"),
                                                                 (WithSequenceFeature, None, "sequence", "sequence")],
                         ids=["pooled", "sequence"])
def test_fast_numerics_send_bf16_and_train_close_to_exact(model, sharding_types, role, module, tmp_path, data_cache):
    dm = tiny_data(data_cache, num_train=768)
    models = {} if model is None else {"model": model}
    report = _fit(dm, tmp_path / "fast", sharding_types, calibrate=False, numerics="fast", **models)
    assert report["executor"] in LIFTED, report["fallback"]
    accepted = {c for c, ok, _ in report["decisions"] if ok}
    assert f"communication_precision:output@{module}" in accepted, accepted
    for direction in ("output", "grad"):
        assert re.search(rf"{direction}_{role} .* bfloat16", report["explain"]), report["explain"]
    _fit(dm, tmp_path / "exact", sharding_types, calibrate=False, **models)
    for fast, exact in zip(load_dumps(tmp_path / "fast", 2), load_dumps(tmp_path / "exact", 2)):
        tables = [k for k in exact if "embedding" in k and not k.startswith("optim/")]
        differ = [k for k in tables if not torch.equal(fast[k], exact[k])]
        assert differ  # the cast really ran
        # 12 steps of BF16 exchanges (8 significant bits) move the tables by ~1e-3 of their scale here
        assert all((fast[k] - exact[k]).abs().max() <= 1e-2 * exact[k].abs().max() for k in differ)


def test_the_consumer_layouts_conversion_is_torchs(tmp_path, data_cache):
    """Both directions cast: the consumer layout's kernel converts the exchanged blocks as it copies
    them; without the consumer layout, torch converts them in the all-to-all's layout. Same bits."""
    dm = tiny_data(data_cache, num_train=768)
    fused = _fit(dm, tmp_path / "fused", TW_CW, calibrate=False, numerics="fast")
    assert "codegen:output@embeddings" in {c for c, ok, _ in fused["decisions"] if ok}
    _fit(dm, tmp_path / "torch", TW_CW, calibrate=False, numerics="fast",
         optimizations=["aggregation", "latency_hiding", "codegen:lookup", "codegen:input", "communication_precision"])
    assert_same_dumps(tmp_path / "torch", tmp_path / "fused")


def test_exact_numerics_never_cast(tmp_path, data_cache):
    report = _fit(tiny_data(data_cache), tmp_path / "exact", TW_CW, calibrate=False)
    precision = [(c, ok) for c, ok, _ in report["decisions"] if c.startswith("communication_precision:")]
    assert precision and not any(ok for _, ok in precision), precision
    assert not re.search(r"bfloat16", report["explain"]), report["explain"]
