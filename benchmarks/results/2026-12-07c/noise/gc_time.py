"""How much of a bench rank's time goes to Python's cyclic GC, per generation: runs ``sparselift
bench`` with every rank's collections timed (``gc.callbacks``) and writes ``gc_rank{N}.json``
(per generation: collections, wall ms, CPU ms, longest ms).

    python gc_time.py --scenario dlrm --systems torchrec,sparselift --seed 1 --json dlrm.json
"""
import gc
import json
import sys
import time

from lightning_sparselift.bench import runner, cli

_t = {}
log = []
def cb(phase, info):
    if phase == "start":
        _t["s"] = (time.perf_counter(), time.thread_time())
    else:
        s = _t.pop("s", None)
        if s:
            log.append((info["generation"], (time.perf_counter() - s[0]) * 1e3, (time.thread_time() - s[1]) * 1e3, info.get("collected", 0)))

orig = runner._worker_main
def worker(rank, config, port, out):
    gc.callbacks.append(cb)
    try:
        orig(rank, config, port, out)
    finally:
        by = {}
        for g, w, c, n in log:
            b = by.setdefault(g, [0, 0.0, 0.0, 0.0])
            b[0] += 1; b[1] += w; b[2] += c; b[3] = max(b[3], w)
        with open(f"gc_rank{rank}.json", "w") as f:
            json.dump({"by_gen": by, "tracked": len(gc.get_objects())}, f)

runner._worker_main = worker
if __name__ == "__main__":
    cli.main(sys.argv[1:])
