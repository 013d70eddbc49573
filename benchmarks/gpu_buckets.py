"""Subgraph parallelism on one GPU: the generated Triton lookup (torch and Triton only, no fbgemm)
with its tables in G = 1, 2, 4, 8 buckets, each bucket on a CUDA stream of the kernel's pool.

Per shape, each G trains the same steps from the same tables through the runtime's
``TableBatchKernel`` (forward pooling, autograd backward with the fused update) under a small dense
top (linear + BCE, torch's SGD): the forward outputs, the loss, the tables, the optimizer state and
the dense weights must equal G = 1's bit for bit, and G = 1's forward must be close to
``torch.nn.functional.embedding_bag`` (float32 sums in another order). Then the steps are timed
with CUDA events, the G's interleaved round by round; printed per G: the median step (forward,
backward, update) and its ratio to G = 1.

    python benchmarks/gpu_buckets.py [--steps 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from lightning_sparselift.runtime.codegen.lookup import TableBatchKernel, build_kernel
from lightning_sparselift.runtime.codegen.spec import KernelSpec, TableSpec

BUCKETS = (1, 2, 4, 8)
# (name, tables, rows per table, dim, batch, ids per bag, optimizer)
SHAPES = [("many small launches", 16, 20_000, 64, 512, 8, "rowwise_adagrad"),
          ("few large launches", 8, 200_000, 128, 8192, 32, "adagrad")]


def spec_of_shape(tables: int, rows: int, dim: int, optimizer: str) -> KernelSpec:
    per_row_state = optimizer == "rowwise_adagrad"
    specs = [TableSpec(rows=rows, dim=dim, weights_offset=t * rows * dim,
                       state_offset=t * rows if per_row_state else t * rows * dim, first_feature=t, end_feature=t + 1)
             for t in range(tables)]
    return KernelSpec(tables=tuple(specs), total_dim=tables * dim, pooling="sum", weighted=False,
                      optimizer=optimizer, eps=1e-8, check_ids=False, device="cuda")


def balanced(tables: int, count: int) -> tuple[tuple[int, ...], ...]:
    """Equal tables, dealt out in turn (the pass balances by ids x dim; here all weigh the same)."""
    return tuple(tuple(range(b, tables, count)) for b in range(count))


class Model:
    """One generated lookup over fbgemm-like flat storage (a namespace in place of fbgemm's module)
    and a linear top; ``step`` is one training step."""

    def __init__(self, spec: KernelSpec, start: dict[str, torch.Tensor], top: torch.nn.Linear) -> None:
        self.tbe = SimpleNamespace(**{k: v.clone() for k, v in start.items()},
                                   learning_rate_tensor=torch.tensor(0.05), iter=torch.zeros(1, dtype=torch.int64),
                                   iter_cpu=torch.zeros(1, dtype=torch.int64), step=0, training=True,
                                   placeholder_autograd_tensor=torch.zeros(0, requires_grad=True))
        self.kernel = TableBatchKernel(self.tbe, spec, build_kernel(spec, "fast"))
        self.top = top
        self.optimizer = torch.optim.SGD(top.parameters(), lr=0.05)

    def step(self, ids: torch.Tensor, offsets: torch.Tensor, batch: int, labels: torch.Tensor):
        pooled = self.kernel.lookup(ids, offsets, None, batch)
        loss = F.binary_cross_entropy_with_logits(self.top(pooled).squeeze(1), labels)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return pooled.detach(), loss.detach()

    def state(self) -> list[torch.Tensor]:
        return [self.tbe.weights_dev, self.tbe.momentum1_dev, *self.top.parameters()]


def make_batches(tables: int, rows: int, batch: int, per_bag: int, count: int, device: torch.device):
    out = []
    for _ in range(count):
        lengths = torch.randint(0, 2 * per_bag + 1, (tables * batch,), device=device)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        # skewed ids (a few hot rows), so rows repeat within and across bags
        ids = (torch.rand(int(offsets[-1]), device=device) ** 3 * rows).long()
        out.append((ids, offsets, (torch.rand(batch, device=device) < 0.3).float()))
    return out


def check_shape(name: str, tables: int, rows: int, dim: int, batch: int, per_bag: int, optimizer: str,
                steps: int, rounds: int, device: torch.device) -> bool:
    torch.manual_seed(0)
    base = spec_of_shape(tables, rows, dim, optimizer)
    size = tables * rows * dim
    start = {"weights_dev": torch.randn(size, device=device) * 0.01,
             "momentum1_dev": torch.zeros(tables * rows if optimizer == "rowwise_adagrad" else size, device=device)}
    top = torch.nn.Linear(tables * dim, 1).to(device)
    batches = make_batches(tables, rows, batch, per_bag, steps, device)
    models, ok = {}, True
    print(f"\n## {name}: {tables} tables x {rows} rows x dim {dim}, batch {batch}, ~{per_bag} ids per bag, "
          f"{optimizer}; {int(batches[0][1][-1])} ids per step")
    for g in BUCKETS:
        spec = base if g == 1 else replace(base, buckets=balanced(tables, g))
        model = Model(spec, start, copy_linear(top))
        outs = [model.step(ids, offsets, batch, labels) for ids, offsets, labels in batches]
        torch.cuda.synchronize(device)
        models[g] = model
        if g == 1:
            reference_outs, reference_state = outs, model.state()
            ids, offsets, _ = batches[0]
            table = start["weights_dev"].view(tables * rows, dim)
            shift = (torch.arange(tables, device=device) * rows).repeat_interleave(batch)
            lengths = offsets[1:] - offsets[:-1]
            expected = F.embedding_bag(ids + shift.repeat_interleave(lengths), table, offsets[:-1], mode="sum",
                                       include_last_offset=False)
            expected = expected.view(tables, batch, dim).permute(1, 0, 2).reshape(batch, tables * dim)
            close = torch.allclose(outs[0][0], expected, rtol=1e-5, atol=1e-6)
            ok &= close
            print(f"G = 1 forward vs torch embedding_bag (allclose rtol 1e-5): {'yes' if close else 'NO'}")
            continue
        same_outs = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(outs, reference_outs))
        same_state = all(torch.equal(a, b) for a, b in zip(model.state(), reference_state))
        streams = len(model.kernel.built.library._streams.get(device, []))
        ok &= same_outs and same_state and streams == min(g, 4)
        print(f"G = {g}: {streams} side streams; outputs and losses over {steps} steps "
              f"{'bit-identical' if same_outs else 'DIFFER'} to G = 1; tables, optimizer state and dense weights "
              f"{'bit-identical' if same_state else 'DIFFER'}")
    times = {g: [] for g in BUCKETS}
    for _ in range(rounds):
        for g, model in models.items():
            startev, endev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for ids, offsets, labels in batches[:3]:  # warm this G's kernels and streams
                model.step(ids, offsets, batch, labels)
            for ids, offsets, labels in batches:
                startev.record()
                model.step(ids, offsets, batch, labels)
                endev.record()
                endev.synchronize()
                times[g].append(startev.elapsed_time(endev))
    one = statistics.median(times[1])
    for g in BUCKETS:
        median = statistics.median(times[g])
        print(f"G = {g}: median step {median:.3f} ms over {len(times[g])} steps "
              f"(p25-p75 {_quantile(times[g], 0.25):.3f}-{_quantile(times[g], 0.75):.3f}); x{median / one:.3f} of G = 1")
    return ok


def copy_linear(module: torch.nn.Linear) -> torch.nn.Linear:
    """A linear layer with ``module``'s weights (each system trains its own copy)."""
    out = torch.nn.Linear(module.in_features, module.out_features).to(module.weight.device)
    out.load_state_dict(module.state_dict())
    return out


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1]


def setup(description: str) -> tuple[argparse.Namespace, torch.device | None]:
    """The scripts' arguments and the GPU they run on (None, said, without one)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return args, None
    os.environ.setdefault("SPARSELIFT_KERNEL_CACHE", tempfile.mkdtemp())
    device = torch.device("cuda", 0)
    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    return args, device


def main() -> int:
    args, device = setup(__doc__.splitlines()[0])
    if device is None:
        return 2
    ok = all([check_shape(*shape, args.steps, args.rounds, device) for shape in SHAPES])
    print("\nresult:", "every G bit-identical to G = 1" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
