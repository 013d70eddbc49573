"""gloo's CPU (process minus training thread) per all-to-all, by payload: the marginal backend CPU
per byte (the slope) against the step model's average (captured total / all collective bytes)."""
import sys, time
from pathlib import Path

import torch
import torch.distributed as dist
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/ (two_ranks)
from two_ranks import spawn

def worker(rank):
    out = []
    for nbytes in (256, 106496, 212992, 1 << 20, 3407872, 6815744):
        send = torch.zeros(nbytes // 4); recv = torch.empty_like(send)
        cpu, wall = [], []
        for rep in range(25):
            dist.barrier()
            p, t, w = time.process_time(), time.thread_time(), time.perf_counter()
            dist.all_to_all_single(recv, send)
            cpu.append(((time.process_time() - p) - (time.thread_time() - t)) * 1e3); wall.append((time.perf_counter() - w) * 1e3)
        out.append((nbytes, sorted(cpu[1:])[12], sorted(wall[1:])[12]))
    if rank == 0:
        for b, c, w in out: print(f"{b:>9d} B  others' CPU {c:6.3f} ms  wall {w:6.3f} ms")
        x = torch.tensor([float(b) for b, _, _ in out]); y = torch.tensor([c for _, c, _ in out])
        A = torch.stack([torch.ones_like(x), x], 1)
        a, s = torch.linalg.lstsq(A, y.unsqueeze(1)).solution.squeeze(1).tolist()
        print(f"fit: {a:.3f} ms + {s*1e6:.3f} ms/MB")

if __name__ == "__main__":
    spawn(worker)
