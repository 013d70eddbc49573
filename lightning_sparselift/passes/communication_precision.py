"""Communication precision: a module's output all-to-alls send their float32 values as BF16 both
ways (the pooled blocks or rows, and their gradients: role ``output``), only under
``numerics="fast"``.

The cast is fused into the copies the layouts already make (``runtime/layout.py``): where a
layout packs several blocks into the send buffer, it writes them as BF16 in that copy, and where
it unpacks what arrived into per-group tensors it converts as it copies; where no copy exists (one
group's contiguous block, the consumer layout's raw buffer) the cast is the one pass over the
data. Nothing else changes: the same values, rounded to BF16 (8 significant bits, float32's
exponent range) on the wire only, then exchanged, decoded to float32 and, for gradients, divided
by world size as before.

Why both directions in one candidate: the consumer layout converts what arrived as it writes it
(``consumer_layout.fused_wire``) only when both directions travel as BF16 (autograd gives a
gradient the dtype of the tensor it flows back to), so one direction alone pays a conversion pass
of its own; and what one direction saves is ~1% of a dlrm step on a CPU host, which no budget
of paired steps resolves there (2026-12-05: -0.87 and -0.67 ms per direction, undecided after 83
pairs), while both together are 2-3% (forced: 1.022-1.029x). The quality bound
(``benchmarks/quality_bound.py``) was fixed for both directions cast.

Why BF16 and not FP16 or INT8 (the other formats TorchRec's codecs offer):

- FP16 keeps 3 more bits but overflows beyond +-65504; overflow must never be silent, and a
  saturation check is one more pass over the data, costing about what the narrower wire saves on a
  machine like this one (a float32 read-only reduction ~0.26 ms per 3.2 MB against a cast of
  ~0.2 ms). FP16 gradients also underflow without a loss scale. BF16 has float32's range: no value
  a float32 can hold overflows or underflows any sooner;
- INT8 quantizes rows of values with a scale and bias each, which is not a copy.

Feasibility: ``numerics="fast"`` (the default ``"exact"`` keeps every bit of TorchRec's path); two or
more ranks; the module has output all-to-alls (a row-wise reduce-scatter would sum in BF16: left
float32), not pipelined per bucket (its pieces are float32), not already quantized by TorchRec's
own codecs (the user's ``qcomms_config`` rules). Only float32 values are cast (the values of
FP16 tables travel as they are). Cost inputs: the bytes the cast takes off the wire per step, on the busiest rank.
Calibration: one warmup pair, then the exchanges' CPU time (``exchange_cpu``: the layouts'
packing and unpacking copies, where the cast is, on the training thread, and the collectives'
threads, which move the bytes saved): on CPU the backend's threads share the cores with the rest of
the step, so what they save is what the step gains, and early start hides the exchange's wait
itself. Measured on whole steps' wall time the cast's 2-3% of a dlrm step (-2.5 ms forced; 1.027x)
stayed undecided after 82 pairs in 3 of 3 calibrations, its noise 3.7-5.7 ms; the exchanges' CPU is
~8 ms of that step (accepted in 4 of 5). What the clock misses: where no early start hides the
exchange, the step also waits less for it (sparse-heavy: -8 to -11 ms on whole steps, -2 ms on this
clock; accepted either way, in more pairs here). On CUDA that clock is the step's wall time.
"""

from __future__ import annotations

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.ir import LiftedModule, SparseGraph
from lightning_sparselift.ir.vocab import CAST_ROLES
from lightning_sparselift.passes.base import Candidate, OptimizationPass

WIRE = "bf16"  # the format this pass sends (see the module docstring)


class CommunicationPrecision(OptimizationPass):
    name = "communication_precision"
    roles = ("output",)
    protocol = CalibrationProtocol(warmup_pairs=1, region="exchange_cpu", settle_steps=0)

    def check(self, graph: SparseGraph, module: LiftedModule, role: str) -> tuple[list[str], dict[str, float]]:
        nodes = [n for n in graph.collectives() if n.module == module.path and n.role in CAST_ROLES]
        reasons = []
        if self.numerics != "fast":
            reasons.append(f"numerics={self.numerics!r} keeps every value bit-identical to TorchRec's path; "
                           f"numerics='fast' lets this pass send {WIRE.upper()}")
        if graph.world_size == 1:
            reasons.append("one rank: nothing is exchanged")
        elif not nodes:
            reasons.append("no output all-to-all (row-wise reduce-scatters would sum in the narrower format; "
                           "data-parallel groups exchange nothing)")
        if module.wire:
            reasons.append(f"TorchRec's quantized communication already encodes {sorted(module.wire)} "
                           f"(the strategy's qcomms_config)")
        if any(module.schedule.wire.get(r) for r in CAST_ROLES):
            reasons.append(f"already {WIRE.upper()}")
        split = [e.label for e in module.schedule.outputs if e.split]
        if split:
            reasons.append(f"output {', '.join(split)} is pipelined per bucket (subgraph parallelism), whose pieces "
                           f"travel as float32")
        sent = [sum(n.bytes_per_member[r] for n in nodes) for r in range(graph.world_size)] if nodes else [0]
        return reasons, {"bytes_saved": max(sent) / 2}

    def rewrite(self, graph: SparseGraph, module: LiftedModule, candidate: Candidate) -> str:
        roles = sorted({n.role for n in graph.collectives() if n.module == module.path and n.role in CAST_ROLES})
        module.schedule.wire.update({r: WIRE for r in roles})
        return f"the output all-to-alls of {module.path} and their gradients send {WIRE.upper()}"
