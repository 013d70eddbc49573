"""fbgemm's CPU table-batched embedding against the generated kernel on the same shapes: thread CPU
time of forward and backward (with the fused update), interleaved call by call, medians.

    .venv/bin/python benchmarks/generated_kernels.py --tables 13 --rows 100000 --dim 64 --batch 2048 --ids-per-bag 1
    .venv/bin/python benchmarks/generated_kernels.py --tables 60 --rows 20000 --dim 32 --batch 1024 --ids-per-bag 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from lightning_sparselift.runtime.codegen.lookup import build_lookup
    from lightning_sparselift.runtime.codegen.cpu_source import cpu_source
    from lightning_sparselift.runtime.codegen.lookup import TableBatchKernel
    from lightning_sparselift.runtime.codegen.spec import spec_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("tables", 13), ("rows", 100_000), ("dim", 64), ("batch", 2048), ("ids-per-bag", 1),
                          ("calls", 12)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--optimizer", default="exact_sgd", choices=["exact_sgd", "exact_adagrad",
                                                                     "exact_row_wise_adagrad"])
    args = parser.parse_args()
    torch.set_num_threads(1)

    def tables() -> SplitTableBatchedEmbeddingBagsCodegen:
        torch.manual_seed(0)
        return SplitTableBatchedEmbeddingBagsCodegen(
            [(args.rows, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * args.tables,
            optimizer=EmbOptimType(args.optimizer), learning_rate=0.1)

    reference, ours = tables(), tables()
    spec = spec_of(ours, weighted=False, check_ids=False)
    built = build_lookup(cpu_source(spec))
    generated = TableBatchKernel(ours, spec, built)
    n = args.ids_per_bag
    lengths = (torch.randint(max(0, n - n // 2), n + n // 2 + 1, (args.tables * args.batch,)) if n > 1
               else torch.ones(args.tables * args.batch, dtype=torch.long))
    ids = (torch.rand(int(lengths.sum())) ** 3 * args.rows).long()  # skewed towards low ids
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(args.tables)], values=ids, lengths=lengths)
    offsets = kjt.offsets()
    grad = torch.randn(args.batch, args.tables * args.dim)
    runs = {"fbgemm": lambda: reference(ids, offsets), "generated": lambda: generated(kjt)}
    times: dict[str, list[float]] = {f"{k} {p}": [] for k in runs for p in ("forward", "backward")}
    for call in range(args.calls + 2):
        for name in (list(runs) if call % 2 == 0 else list(reversed(runs))):
            start = time.thread_time()
            out = runs[name]()
            middle = time.thread_time()
            out.backward(grad)
            end = time.thread_time()
            if call >= 2:  # (the first calls warm caches and allocators)
                times[f"{name} forward"].append((middle - start) * 1e3)
                times[f"{name} backward"].append((end - middle) * 1e3)
    print(f"{args.tables} tables x {args.rows} rows x dim {args.dim}, batch {args.batch}, {ids.numel()} ids, "
          f"{args.optimizer}; kernel {'from the cache' if built.cached else 'compiled'} in {built.build_s:.2f} s")
    for key, values in times.items():
        print(f"  {key:<20s} {statistics.median(values):7.3f} ms (thread CPU, median of {len(values)})")
    for phase in ("forward", "backward"):
        ratio = statistics.median(times[f"generated {phase}"]) / statistics.median(times[f"fbgemm {phase}"])
        print(f"  generated / fbgemm {phase}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
