"""Instrumentation cost of timing the reference concatenation: dlrm's shape (1024 rows per rank, 26 keys of 64)."""
import time, statistics, torch
from torchrec.sparse.jagged_tensor import KeyedTensor
from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.runtime.consumer_layout import timed_reference
torch.set_num_threads(1)
keys=[f"k{i}" for i in range(26)]; B=1024; D=64
out=torch.randn(B, 26*D, requires_grad=True); w=torch.randn(B, 26*D)
def step(timed):
    clock=RegionClock(torch.device("cpu")); clock.start_step()
    kt=KeyedTensor(keys=keys, length_per_key=[D]*26, values=out*1.0, key_dim=1)
    if timed: kt=timed_reference(kt, clock)
    t0=time.thread_time()
    d=kt.to_dict(); cat=torch.cat([d[k] for k in keys], dim=1); (cat*w).sum().backward()
    total=(time.thread_time()-t0)*1e3
    out.grad=None
    return total, clock.concatenation_ms
for timed in (False, True, False, True):
    r=[step(timed) for _ in range(200)]
    print("timed" if timed else "plain", "thread ms median %.3f" % statistics.median(x for x,_ in r), "clock %.3f" % statistics.median(c for _,c in r))
