"""fbgemm's CPU lookup of data-parallel tables (TorchRec's path for them): its gradient is
embedding_bag's, and with the AutogradCPU fallthrough the strategy registers it trains without
torch's "autograd kernel was not registered" warning."""

import warnings

import pytest
import torch

from lightning_sparselift.torchrec_parts import register_dense_lookup_autograd


@pytest.mark.parametrize("weighted", [False, True])
def test_the_data_parallel_lookup_has_embedding_bags_gradient_and_no_warning(weighted):
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

    register_dense_lookup_autograd()
    register_dense_lookup_autograd()  # (idempotent)
    torch.manual_seed(0)
    tables = [(50, 8), (30, 4)]
    lookup = DenseTableBatchedEmbeddingBagsCodegen(tables, pooling_mode=0, use_cpu=True)
    ids = torch.tensor([1, 2, 2, 7, 3, 0, 29, 5, 5])
    offsets = torch.tensor([0, 2, 4, 6, 9])  # 2 tables x 2 bags
    weights = torch.tensor([0.5, 1, 2, -1, 1, 3, 0.1, 2, 1]) if weighted else None
    with warnings.catch_warnings(record=True) as caught:  # (torch's C++ warnings are not raised as errors)
        warnings.simplefilter("always")
        out = lookup(ids, offsets, per_sample_weights=weights)
        upstream = torch.randn_like(out)
        (out * upstream).sum().backward()
    assert [str(w.message) for w in caught] == []

    flat = lookup.weights.detach()
    refs, outs, start = [], [], 0
    for t, (rows, dim) in enumerate(tables):
        ref = flat[start:start + rows * dim].view(rows, dim).clone().requires_grad_()
        lo, hi = int(offsets[2 * t]), int(offsets[2 * t + 2])
        outs.append(torch.nn.functional.embedding_bag(ids[lo:hi], ref, offsets[2 * t:2 * t + 2] - lo, mode="sum",
                                                      per_sample_weights=None if weights is None else weights[lo:hi]))
        refs.append(ref)
        start += rows * dim
    expected = torch.cat(outs, dim=1)
    (expected * upstream).sum().backward()
    assert torch.equal(out, expected)
    assert torch.equal(lookup.weights.grad, torch.cat([r.grad.flatten() for r in refs]))
