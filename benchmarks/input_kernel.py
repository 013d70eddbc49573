"""The generated input kernel's permute, bucketize and recat against the reference kernels
(TorchRec's KJT permute, fbgemm's block bucketize and permute_2D_sparse_data), one process, one
thread, on a sparse-heavy-like shape (rank 0's share: multi-hot bags over many keys, 2 ranks):
thread CPU per call, the two interleaved, with what the next step reads (per-key sums, offsets).

    .venv/bin/python benchmarks/input_kernel.py --keys 60 --batch 512 --world 2
"""

from __future__ import annotations

import argparse
import time
from statistics import median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=60)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--max-bag", type=int, default=20, help="bag lengths uniform in [0, max-bag)")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table (row-wise: world blocks)")
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()

    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from lightning_sparselift.runtime.input_layout import InputKernel
    from lightning_sparselift.runtime.kernels import bucketize_fbgemm, permute_torchrec, recat_fbgemm, recat_order

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    keys, batch, world = args.keys, args.batch, args.world
    names = [f"f{i}" for i in range(keys)]
    lengths = torch.randint(0, args.max_bag, (keys * batch,), generator=g)
    values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g)
    features = KeyedJaggedTensor(keys=names, values=values, weights=weights, lengths=lengths, stride=batch)
    order = [int(o) for o in torch.randperm(keys, generator=g)]
    order_tensor = torch.tensor(order, dtype=torch.int32)
    blocks = [-(-args.rows // world)] * keys
    block_tensor = torch.tensor(blocks)
    recat = recat_order(keys, world)
    arrived = (lengths.repeat(world), values.repeat(world), weights.repeat(world))  # every rank sent the same
    kernel = InputKernel(order, keys, [keys], world, torch.device("cpu"), [blocks])

    cases = {
        "permute": (lambda: permute_torchrec(features, order, order_tensor).split([keys]),
                    lambda: kernel.permute(features, order, order_tensor).split([keys])),
        "bucketize": (lambda: bucketize_fbgemm(features, block_tensor, world, False)[0].length_per_key(),
                      lambda: kernel.bucketize(0, features, block_tensor, world, False)),
        "recat": (lambda: recat_fbgemm(names, recat, *arrived, batch, world).offsets(),
                  lambda: kernel.recat(0, names, recat, *arrived, batch, world).offsets()),
    }
    print(f"{values.numel()} ids, {keys} keys, batch {batch}, {world} ranks; thread CPU ms per call, median of "
          f"{args.calls} interleaved")
    for name, (reference, generated) in cases.items():
        times: dict[str, list[float]] = {"reference": [], "generated": []}
        for call in range(args.calls):
            arms = [("reference", reference), ("generated", generated)]
            for arm, run in arms if call % 2 else arms[::-1]:
                start = time.thread_time()
                run()
                times[arm].append((time.thread_time() - start) * 1e3)
        ref, gen = median(times["reference"]), median(times["generated"])
        print(f"{name:<10s} reference {ref:7.3f}  generated {gen:7.3f}  ratio {gen / ref:.2f}")


if __name__ == "__main__":
    main()
