"""Hardware profiles: what the simulator prices a step with on machines that never ran here, as
plain data in YAML (the fields of :class:`HardwareProfile`, documented below and in the shipped
files). ``profiles/`` ships an 8-GPU NVLink node with a 400 Gb/s-per-GPU network (published
figures, cited in the file) and this CPU machine as measured (written by ``sparselift simulate
fit-profile``, not typed in); ``--profile PATH`` reads a user's own.

A profile becomes the step-time model's machine inputs per world size (:meth:`HardwareProfile.all_to_all`):
an all-to-all over ``world`` ranks, ``ranks_per_node`` of them per node, sends each peer
``1/world`` of a member's bytes, the peers in its node over the intra-node link and the others over
the inter-node one at once; its latency grows with the peers it posts a message to. So
``t(bytes) = alpha + bytes * beta`` with

    alpha = intra.alpha + intra.per_peer * (local - 1) [+ inter.alpha + inter.per_peer * (world - local)]
    beta  = max((local - 1) / world / intra.bandwidth, (world - local) / world / inter.bandwidth)

(``local = min(world, ranks_per_node)``): bytes per peer shrink like ``1/world``, so at large
world sizes the latency terms dominate. The all-reduce of the dense gradients is a ring over the
slowest link: ``alpha + 2 (world - 1) / world * bytes / bandwidth``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from lightning_sparselift.cost.priors import AlphaBeta
from lightning_sparselift.typed_json import decode

PROFILES = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "h100-nvlink-8x400g"


@dataclass
class Link:
    """One kind of link, as a collective sees it from a rank."""

    alpha_us: float  # a collective's fixed latency over this link (launch and synchronisation)
    per_peer_us: float  # latency added per peer the rank exchanges a message with over this link
    gb_per_s: float  # bandwidth per rank and direction, GB/s (1e9 bytes)

    def ms_per_byte(self) -> float:
        return 1.0 / (self.gb_per_s * 1e6)


@dataclass
class Device:
    kind: Literal["cpu", "cuda"]
    # dense matrix throughput a training step's layers reach (not the peak: peak x the efficiency
    # the file states), TFLOP/s; prices the dense forward and backward from their counted FLOPs
    dense_tflops: float
    # bytes per ms a copy reads and writes (a read and a write per byte), GB/s: the sparse path's
    # regions and lookups are priced as passes over their bytes at this rate
    memory_gb_per_s: float
    launch_us: float  # per kernel or collective call on the training thread's stream (0 on CPU)
    # lookups of one module that run at once (CUDA streams; on CPU: the cores per rank)
    concurrent_lookups: float
    memory_gib: float  # what TorchRec's planner may place per rank
    # "flops": the dense step from its counted FLOPs at ``dense_tflops`` and a launch per kernel;
    # "timed": timed by running the model's dense part here, and TorchRec's whole step at one rank
    # (its lookups' rate and its host work per step; a profile of the machine that simulates: a
    # single throughput does not carry from one model's layers, or one table set, to another's)
    dense: Literal["flops", "timed"] = "flops"


@dataclass
class HardwareProfile:
    name: str
    description: str
    device: Device
    ranks_per_node: int
    intra_node: Link
    inter_node: Link
    # the collectives' backend CPU per MB a rank puts in, where it takes the training thread's core
    # (a CPU rank with fewer than 2 cores); 0 elsewhere
    backend_cpu_ms_per_mb: float = 0.0
    sources: list[str] = field(default_factory=list)  # where each figure comes from
    measured: Optional[dict[str, Any]] = None  # a fitted profile: the run it was fitted on

    @classmethod
    def load(cls, name_or_path: str) -> "HardwareProfile":
        """A shipped profile by name (``profiles/<name>.yaml``) or a YAML file; ValueError naming
        the field that is missing or of the wrong type."""
        path = Path(name_or_path)
        if not path.exists():
            shipped = PROFILES / f"{name_or_path}.yaml"
            if not shipped.exists():
                raise ValueError(f"no hardware profile {name_or_path!r}: not a file, and not one of the shipped "
                                 f"profiles {shipped_profiles()}")
            path = shipped
        data = yaml.safe_load(path.read_text())
        profile = decode(cls, data, path.name)
        profile.check(path.name)
        return profile

    def check(self, where: str) -> None:
        numbers = {"device.dense_tflops": self.device.dense_tflops,
                   "device.memory_gb_per_s": self.device.memory_gb_per_s,
                   "device.concurrent_lookups": self.device.concurrent_lookups,
                   "device.memory_gib": self.device.memory_gib,
                   "intra_node.gb_per_s": self.intra_node.gb_per_s, "inter_node.gb_per_s": self.inter_node.gb_per_s,
                   "ranks_per_node": self.ranks_per_node}
        for name, value in numbers.items():
            if value <= 0:
                raise ValueError(f"{where}: {name} must be positive, got {value}")
        for name, value in {"device.launch_us": self.device.launch_us, "intra_node.alpha_us": self.intra_node.alpha_us,
                            "intra_node.per_peer_us": self.intra_node.per_peer_us,
                            "inter_node.alpha_us": self.inter_node.alpha_us,
                            "inter_node.per_peer_us": self.inter_node.per_peer_us,
                            "backend_cpu_ms_per_mb": self.backend_cpu_ms_per_mb}.items():
            if value < 0:
                raise ValueError(f"{where}: {name} must not be negative, got {value}")

    def save(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(asdict(self), sort_keys=False, width=110))

    # ------------------------------------------------------------------ per world size
    def all_to_all(self, world: int, process_group: str) -> AlphaBeta:
        """The all-to-all's alpha-beta over ``world`` ranks (bytes: what a member puts in)."""
        local = min(world, self.ranks_per_node)
        intra, inter = self.intra_node, self.inter_node
        alpha_us = intra.alpha_us + intra.per_peer_us * (local - 1)
        beta = (local - 1) / world * intra.ms_per_byte()
        if world > local:
            alpha_us += inter.alpha_us + inter.per_peer_us * (world - local)
            beta = max(beta, (world - local) / world * inter.ms_per_byte())
        return AlphaBeta("all_to_all_single", process_group, alpha_us / 1e3, beta, [])

    def all_reduce_ms(self, world: int, nbytes: float) -> float:
        """A ring all-reduce of ``nbytes`` over ``world`` ranks, at the slowest link's bandwidth."""
        if world <= 1:
            return 0.0
        link = self.inter_node if world > self.ranks_per_node else self.intra_node
        return link.alpha_us / 1e3 + 2 * (world - 1) / world * nbytes * link.ms_per_byte()

    def dense_ms(self, flops: float) -> float:
        return flops / (self.device.dense_tflops * 1e9)

    @property
    def bandwidth_bytes_per_ms(self) -> float:
        return self.device.memory_gb_per_s * 1e6


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.yaml"))
