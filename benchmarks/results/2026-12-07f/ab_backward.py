"""The generated backward of an older ``cpu_source.py`` against the installed one on identical fbgemm
modules (and fbgemm's own), interleaved call by call, thread CPU medians; the tables compared bitwise
after the run. For this folder's README:

    git show 713e291:lightning_sparselift/runtime/codegen/cpu_source.py > /tmp/ab/old_cpu_source.py
    PYTHONPATH=/tmp/ab .venv/bin/python benchmarks/results/2026-12-07f/ab_backward.py --mix
    PYTHONPATH=/tmp/ab .venv/bin/python benchmarks/results/2026-12-07f/ab_backward.py --tables 13 --rows 100000 --dim 64 --batch 2048 --ids-per-bag 1
"""
import argparse, statistics, time
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from lightning_sparselift.runtime.codegen.lookup import build_lookup, TableBatchKernel
from lightning_sparselift.runtime.codegen.cpu_source import cpu_source
from lightning_sparselift.runtime.codegen.spec import spec_of
import old_cpu_source

p = argparse.ArgumentParser()
for name, default in (("tables", 60), ("rows", 20000), ("dim", 32), ("batch", 1024), ("ids-per-bag", 6), ("calls", 30)):
    p.add_argument(f"--{name}", type=int, default=default)
p.add_argument("--optimizer", default="exact_sgd")
p.add_argument("--weighted", action="store_true")
p.add_argument("--mix", action="store_true", help="sparse-heavy's mixture of rows, dims and pooling")
a = p.parse_args()
torch.set_num_threads(1)
ROWS = [[2000, 20000, 100000, 5000, 50000][t % 5] if a.mix else a.rows for t in range(a.tables)]
DIMS = [[16, 32, 64, 128][t % 4] if a.mix else a.dim for t in range(a.tables)]
POOL = [[1, 2, 4, 8, 20, 3][t % 6] if a.mix else a.ids_per_bag for t in range(a.tables)]
def tables():
    torch.manual_seed(0)
    return SplitTableBatchedEmbeddingBagsCodegen([(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in zip(ROWS, DIMS)],
                                                 optimizer=EmbOptimType(a.optimizer), learning_rate=0.1)
ref, t_old, t_new = tables(), tables(), tables()
spec = spec_of(t_new, weighted=a.weighted, check_ids=False)
k_old = TableBatchKernel(t_old, spec, build_lookup(old_cpu_source.cpu_source(spec)))
k_new = TableBatchKernel(t_new, spec, build_lookup(cpu_source(spec)))
n = a.ids_per_bag
lengths = torch.cat([torch.poisson(torch.full((a.batch,), float(POOL[t]))).long() if POOL[t] > 1 else torch.ones(a.batch, dtype=torch.long) for t in range(a.tables)])
ids = torch.cat([(torch.rand(int(l.sum())) ** 3 * ROWS[t]).long() for t, l in enumerate(lengths.split(a.batch))])
w = torch.rand(ids.numel()) if a.weighted else None
kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(a.tables)], values=ids, lengths=lengths, weights=w)
grad = torch.randn(a.batch, sum(DIMS))
runs = {"old": lambda: k_old(kjt), "new": lambda: k_new(kjt), "fbgemm": lambda: ref(ids, kjt.offsets(), per_sample_weights=w)}
times = {k: [] for k in runs}
for call in range(a.calls + 2):
    order = list(runs) if call % 2 == 0 else list(reversed(runs))
    for name in order:
        out = runs[name]()
        s = time.thread_time(); out.backward(grad); e = time.thread_time()
        if call >= 2: times[name].append((e - s) * 1e3)
for k, v in times.items(): print(f"{k:8s} backward {statistics.median(v):7.3f} ms")
print("new/old", statistics.median(times["new"]) / statistics.median(times["old"]))
def w_of(t): return t.weights_host if hasattr(t, "weights_host") else t.weights
print("bitwise new==old", torch.equal(w_of(t_old), w_of(t_new)), "new==fbgemm", torch.equal(w_of(ref), w_of(t_new)))
