"""The generated Triton lookup (one GPU, no fbgemm) against torch's own sparse path: per step,
pooled lookups of every table, a linear top, BCE, and Adagrad on the touched rows.

- generated: the runtime's ``TableBatchKernel`` (forward pooling, backward with the fused Adagrad
  update of the touched rows);
- torch: ``F.embedding_bag(sparse=True)`` over the tables stacked in one parameter, then
  ``torch.optim.Adagrad`` on its sparse gradient.

Both start from the same tables; after the timed steps the tables must agree within float32
rounding (different summation orders), which is printed. Steps are timed with CUDA events, the
two systems interleaved round by round; printed per shape: each median step and their ratio.

    python benchmarks/triton_vs_torch.py [--steps 20] [--rounds 5]
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from gpu_buckets import Model, copy_linear, make_batches, setup, spec_of_shape

# (name, tables, rows per table, dim, batch, ids per bag)
SHAPES = [("dlrm-like, ~1 id per bag", 26, 100_000, 128, 2048, 1),
          ("multi-hot", 8, 200_000, 128, 8192, 32)]


class TorchModel:
    def __init__(self, tables: int, rows: int, dim: int, start: torch.Tensor, top: torch.nn.Linear) -> None:
        self.rows, self.tables = rows, tables
        self.weight = torch.nn.Parameter(start.view(tables * rows, dim).clone())
        self.top = top
        self.sparse = torch.optim.Adagrad([self.weight], lr=0.05, eps=1e-8)
        self.dense = torch.optim.SGD(top.parameters(), lr=0.05)

    def step(self, ids: torch.Tensor, offsets: torch.Tensor, batch: int, labels: torch.Tensor):
        lengths = offsets[1:] - offsets[:-1]
        shift = (torch.arange(self.tables, device=ids.device) * self.rows).repeat_interleave(batch)
        pooled = F.embedding_bag(ids + shift.repeat_interleave(lengths), self.weight, offsets[:-1], mode="sum",
                                 sparse=True)
        pooled = pooled.view(self.tables, batch, -1).permute(1, 0, 2).reshape(batch, -1)
        loss = F.binary_cross_entropy_with_logits(self.top(pooled).squeeze(1), labels)
        self.sparse.zero_grad()
        self.dense.zero_grad()
        loss.backward()
        self.sparse.step()
        self.dense.step()
        return pooled.detach(), loss.detach()


def compare(name: str, tables: int, rows: int, dim: int, batch: int, per_bag: int, steps: int, rounds: int,
            device: torch.device) -> None:
    torch.manual_seed(0)
    start = torch.randn(tables * rows * dim, device=device) * 0.01
    top = torch.nn.Linear(tables * dim, 1).to(device)
    batches = make_batches(tables, rows, batch, per_bag, steps, device)
    spec = spec_of_shape(tables, rows, dim, "adagrad")
    generated = Model(spec, {"weights_dev": start, "momentum1_dev": torch.zeros_like(start)}, copy_linear(top))
    reference = TorchModel(tables, rows, dim, start, copy_linear(top))
    print(f"\n## {name}: {tables} tables x {rows} rows x dim {dim}, batch {batch}, ~{per_bag} ids per bag; "
          f"{int(batches[0][1][-1])} ids per step")
    times: dict[str, list[float]] = {"generated": [], "torch": []}
    for _ in range(rounds):
        for label, model in (("generated", generated), ("torch", reference)):
            for ids, offsets, labels in batches:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                model.step(ids, offsets, batch, labels)
                end.record()
                end.synchronize()
                times[label].append(begin.elapsed_time(end))
    difference = (generated.tbe.weights_dev.view(tables * rows, dim) - reference.weight.detach()).abs().max().item()
    print(f"tables after {rounds * steps} steps each: largest difference {difference:.3g}")
    medians = {k: statistics.median(v) for k, v in times.items()}
    for label, median in medians.items():
        print(f"{label}: median step {median:.3f} ms over {len(times[label])} steps")
    print(f"generated / torch: x{medians['generated'] / medians['torch']:.3f}")


def main() -> int:
    args, device = setup(__doc__.splitlines()[0])
    if device is None:
        return 2
    for shape in SHAPES:
        compare(*shape, args.steps, args.rounds, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
