import sys, time, resource, statistics
sys.path.insert(0, 'benchmarks')
from two_ranks import bench_env, spawn, warmed_up

def worker(rank, scenario, which):
    from lightning_sparselift.bench.systems.torchrec import TorchRecSparseDist
    from lightning_sparselift.bench.systems.sparselift import SparseLift
    env = bench_env(rank, scenario)
    system = {"torchrec": lambda: TorchRecSparseDist(env), "identity": lambda: SparseLift(env, {"optimizations": [], "calibrate": False}),
              "codegen": lambda: SparseLift(env, {"optimizations": ["codegen"], "calibrate": False})}[which]()
    step = warmed_up(system, 12)
    a = resource.getrusage(resource.RUSAGE_THREAD); t = time.thread_time(); w = time.perf_counter()
    n = 30
    for i in range(n):
        system.step(step + i)
    b = resource.getrusage(resource.RUSAGE_THREAD)
    if rank == 0:
        print(scenario, which, 'alone: wall ms/step', round((time.perf_counter() - w) * 1e3 / n, 1), 'thread ms/step', round((time.thread_time() - t) * 1e3 / n, 1), 'faults/step', (b.ru_minflt - a.ru_minflt) // n, 'sys ms/step', round((b.ru_stime - a.ru_stime) * 1e3 / n, 1), flush=True)

if __name__ == "__main__":
    spawn(worker, sys.argv[1], sys.argv[2])
