"""What the step-time model (:mod:`~lightning_sparselift.cost.step_model`) reads and writes, as
plain data recorded in the plan file: its measured inputs (the capture steps' timings, the
machine's links, bandwidth and cores) and its predictions (a graph's step with the sparse path's
parts, and the identity plan's and the plan's, side by side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import TYPE_CHECKING

from lightning_sparselift.cost.priors import AlphaBeta

if TYPE_CHECKING:
    from lightning_sparselift.frontend.capture import RankCapture

BACKWARD_RATIO = 2.0  # autograd replays a window's dense compute at about twice its forward cost


@dataclass
class StepTimings:
    """What the capture steps measured, per rank (each on its own clock): the median over the
    captured steps (the first one left out when there are more: it builds TorchRec's dists)."""

    step_ms: list[float]
    window_ms: dict[str, list[float]]  # per sparse module path
    # per sparse module path: TorchRec's lookups, forward and backward, on the training thread's CPU clock
    lookup_ms: dict[str, list[float]] = field(default_factory=dict)
    # the process's CPU beyond the training thread's per step: the collectives' backend threads
    backend_cpu_ms: list[float] = field(default_factory=list)

    @classmethod
    def from_captures(cls, captures: list[RankCapture]) -> "StepTimings":
        ordered = sorted(captures, key=lambda c: c.rank)
        paths = sorted({p for c in ordered for p in c.modules})

        def per_rank(what: str) -> dict[str, list[float]]:
            return {p: [_typical(getattr(c.modules[p], what)) if p in c.modules else 0.0 for c in ordered]
                    for p in paths}

        return cls([_typical(c.step_ms) for c in ordered], per_rank("window_ms"), per_rank("lookup_ms"),
                   [_typical(c.other_cpu_ms) for c in ordered])


def _typical(values: list[float]) -> float:
    kept = values[1:] if len(values) > 1 else values
    return float(median(kept)) if kept else 0.0


@dataclass
class StepModelInputs:
    timings: StepTimings
    links: list[AlphaBeta]  # per process group
    bandwidth_bytes_per_ms: float
    cores_per_rank: float  # cores on the rank's host over the ranks on it
    backward_ratio: float = BACKWARD_RATIO
    # the training thread's cost of issuing one kernel or collective call (a CUDA launch; 0 on CPU,
    # where the byte passes hold it)
    launch_ms: float = 0.0
    # per input-region node id, per rank: TorchRec's kernel of a region a generated kernel can replace,
    # timed on the node's shape (:mod:`~lightning_sparselift.session.input_probe`); the regions missing are priced by bytes
    reference_input_ms: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class StepPrediction:
    """One graph's predicted step (ms), on the slowest rank, with the sparse path's parts."""

    step_ms: float
    sparse_forward_ms: float
    sparse_backward_ms: float
    collectives_ms: float  # the collectives' modelled time, exposed or not (slowest rank's sum)
    hidden_ms: float  # of it, overlapped by dense compute
    compute_ms: float  # the sparse path's modelled compute on the training thread

    @property
    def sparse_ms(self) -> float:
        return self.sparse_forward_ms + self.sparse_backward_ms

    def describe(self) -> str:
        return (f"step {self.step_ms:.2f} ms: sparse forward {self.sparse_forward_ms:.2f}, backward "
                f"{self.sparse_backward_ms:.2f} (collectives {self.collectives_ms:.2f}, {self.hidden_ms:.2f} of it "
                f"overlapped; compute {self.compute_ms:.2f})")


@dataclass
class StepModelRecord:
    """What a plan file keeps of the model: its inputs and its predictions for the identity plan
    and the plan."""

    inputs: StepModelInputs
    identity: StepPrediction
    plan: StepPrediction

    @property
    def change_ms(self) -> float:
        return self.plan.step_ms - self.identity.step_ms

    def explain(self) -> list[str]:
        links = "; ".join(f"{link.op} on {link.process_group}: alpha {link.alpha_ms:.3f} ms + "
                          f"{link.beta_ms_per_byte * 1e6:.3f} ms/MB" for link in self.inputs.links)
        timings = self.inputs.timings

        def per_module(values: dict[str, list[float]]) -> str:
            return ", ".join(f"{path} {'/'.join(f'{v:.2f}' for v in ms)}" for path, ms in values.items()) or "none"

        return [f"step-time model: {links}; copy bandwidth {self.inputs.bandwidth_bytes_per_ms / 1e6:.2f} GB/s; "
                f"{self.inputs.cores_per_rank:g} core(s) per rank; captured step "
                f"{'/'.join(f'{t:.2f}' for t in timings.step_ms)} ms per rank, dense window before the module "
                f"(ms per rank) {per_module(timings.window_ms)}, TorchRec's lookups {per_module(timings.lookup_ms)}, "
                f"TorchRec's input kernels {per_module(self.inputs.reference_input_ms)}",
                f"  identity plan: {self.identity.describe()}",
                f"  this plan:     {self.plan.describe()}; change {self.change_ms:+.3f} ms"]
