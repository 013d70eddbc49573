"""The schedule of a lifted module: how its training step runs. Passes write it; the runtime
executes it (it builds its exchanges and kernels from it once, when a plan is installed).

- input exchanges: buckets of sharding groups whose input distribution travels together (one
  splits all-to-all, then the payload: TorchRec's one all-to-all per tensor, or one byte-packed
  all-to-all), where they are issued (at the lookups, or a step ahead) and on which process group
  (and, on CUDA, stream);
- ``lookup_at``: where the lookups run and the output exchanges are issued (the module's call,
  or the root forward's start);
- output exchanges: buckets of groups whose lookup outputs travel back together (all-to-all of
  pooled blocks or of an EmbeddingCollection's rows, or row-wise reduce-scatter) and where the
  module's call waits for them; their
  gradients run the same points in reverse (issued where the forward waited, waited where it was
  issued, i.e. before the fused update);
- regions: the kernel that runs each compute region (a generated lookup's tables in buckets: run
  concurrently, or pipelined: bucket after bucket, each bucket's output all-to-all on a process
  group of its own, issued as soon as its lookups are done);
- ``wire``: the format the output all-to-alls' values travel in, by collective role (ir/steps:
  ``output_pooled``, ``grad_pooled``, ``output_sequence``, ``grad_sequence``), where the
  communication-precision pass chose a narrower one than the values' float32 (under
  ``numerics="fast"``); TorchRec's own quantized communication is the module's
  (``LiftedModule.wire``), not the schedule's.

What no schedule holds, because none may skip it: the runtime passes a module's gradients through
its update guard before any of them reaches a gradient exchange or a fused update
(``runtime/update_guard.py``), so no schedule updates on a step the ranks' step check stops.

Example (one table-wise group, aggregation and latency hiding applied)::

    lookup_at root_forward
    input  [g0] bytes, issued previous_step
    output [g0] all_to_all_single, waited module_call
    region lookup [g0] kernel torchrec
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from lightning_sparselift.ir.vocab import (
    CAST_FORMATS, CAST_ROLES, INPUT_ALL_TO_ALL, POOLED_ALL_TO_ALL_OP, ROW_SHARDED, WIRE_ROLES, Packing, Point,
    RegionName, WireFormat, output_collective,
)

# the kernels TorchRec's own path runs, per region
REFERENCE_KERNELS: dict[str, str] = {"permute": "torchrec", "bucketize": "fbgemm", "recat": "fbgemm",
                                     "lookup": "torchrec", "output": "torchrec"}
# a kernel generated for the rank's tables (lookups, runtime/codegen) or the module's keys (the
# input regions, runtime/input_layout)
GENERATED_KERNEL = "generated"
INPUT_REGIONS = ("permute", "bucketize", "recat")
# the output written straight into the model's concatenation of it (runtime/consumer_layout)
CONSUMER_KERNEL = "consumer"
# the group a module-wide generated kernel's build is recorded under (plan.types.KernelBuild)
OUTPUT_KERNEL_GROUP = -1  # the consumer layout (the output region)
INPUT_KERNEL_GROUP = -2  # the input kernel (its regions: INPUT_REGIONS, runtime/input_layout)


class ScheduleError(ValueError):
    """A schedule that does not describe a step the runtime can execute."""


@dataclass
class Exchange:
    """Sharding groups whose data travel together (a bucket), on one process group (and, on CUDA,
    one stream)."""

    groups: list[int]
    process_group: str = field(default="world", kw_only=True)
    stream: Optional[str] = field(default=None, kw_only=True)

    @property
    def label(self) -> str:
        return bucket_label(self.groups)


@dataclass
class InputExchange(Exchange):
    packing: Packing
    issue: Point  # lookup_at (distributed when the lookups need it) or previous_step (a step ahead)


@dataclass
class OutputExchange(Exchange):
    op: Literal["all_to_all_single", "reduce_scatter"]
    # lookup_at or module_call (left in flight from an early start); waited at module_call
    # (whether the lookups ran there or earlier) means when the model first reads the call's output
    wait: Point
    # pipelined buckets: one all-to-all per bucket of the group's lookup region, on these process
    # groups (one each, in bucket order), each issued when its bucket's lookups are done; [] = one
    split: list[str] = field(default_factory=list, kw_only=True)


@dataclass
class Region:
    name: RegionName
    groups: list[int]  # [] for the module-wide regions (permute, output)
    kernel: str
    # a generated lookup's tables (by name) in buckets run concurrently; [] = one after the other
    buckets: list[list[str]] = field(default_factory=list, kw_only=True)


@dataclass
class ModuleSchedule:
    lookup_at: Point
    inputs: list[InputExchange] = field(default_factory=list)
    outputs: list[OutputExchange] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    wire: dict[str, WireFormat] = field(default_factory=dict)

    def region(self, name: str, group: Optional[int] = None) -> Region:
        for r in self.regions:
            if r.name == name and (group is None or group in r.groups):
                return r
        raise KeyError((name, group))

    @property
    def pooled_wire(self) -> str:
        """The format both directions of the pooled all-to-alls travel in when they share one
        (the consumer layout then converts as it copies), else ""."""
        formats = {self.wire.get(r, "") for r in WIRE_ROLES[POOLED_ALL_TO_ALL_OP]}
        return formats.pop() if len(formats) == 1 else ""

    @property
    def input_issue(self) -> Point:
        """Where the input distribution starts (one point per module: the executor starts it once)."""
        return self.inputs[0].issue if self.inputs else self.lookup_at


def describe_buckets(buckets: list[list[str]]) -> str:
    """A lookup's tables in buckets, as text: ``t0,t1 | t2``."""
    return " | ".join(",".join(b) for b in buckets)


def bucket_process_group(bucket: int) -> str:
    """The name of the process group a pipelined bucket's all-to-alls run on (the runtime
    creates it over the training's ranks when a schedule first names it)."""
    return f"bucket{bucket}"


def bucket_label(groups: list[int]) -> str:
    return "+".join(f"g{g}" for g in groups)


def identity_schedule(kinds: list[Optional[str]], world: int, permuted: bool, pooled: bool = True) -> ModuleSchedule:
    """TorchRec's step for a module whose groups have sharding types ``kinds`` (``pooled``: an
    EmbeddingBagCollection, else an EmbeddingCollection; None: a group that keeps TorchRec's path,
    whose lookup region runs TorchRec's modules of the group, exchanges included): each group's
    input and output exchanged on its own, synchronously, at the module's call, by the reference
    kernels."""
    exchanged = world > 1
    inputs = [InputExchange([i], "per_tensor", "module_call") for i, k in enumerate(kinds)
              if exchanged and k in INPUT_ALL_TO_ALL]
    outputs = [OutputExchange([i], op, "module_call") for i, k in enumerate(kinds)
               if exchanged and (op := output_collective(k, pooled)) is not None]
    regions = [Region("permute", [], REFERENCE_KERNELS["permute"])] if permuted else []
    regions += [Region("bucketize", [i], REFERENCE_KERNELS["bucketize"]) for i, k in enumerate(kinds) if k in ROW_SHARDED]
    regions += [Region("recat", [g], REFERENCE_KERNELS["recat"]) for e in inputs for g in e.groups]
    regions += [Region("lookup", [i], REFERENCE_KERNELS["lookup"]) for i in range(len(kinds))]
    regions.append(Region("output", [], REFERENCE_KERNELS["output"]))
    return ModuleSchedule("module_call", inputs, outputs, regions)


def check_schedule(schedule: ModuleSchedule, kinds: list[Optional[str]], world: int, pooled: bool = True
                   ) -> list[str]:
    """What makes ``schedule`` not executable for groups of sharding types ``kinds`` (None: the
    group keeps TorchRec's path) of a module whose lookups pool (``pooled``) or not ([]: fine)."""
    problems = []
    exchanged = world > 1
    if schedule.lookup_at not in ("module_call", "root_forward"):
        problems.append(f"lookups at {schedule.lookup_at}: they run at the module call or the root forward")

    def cover(buckets: list[list[int]], expected: list[int], what: str) -> None:
        flat = [g for b in buckets for g in b]
        if sorted(flat) != expected or len(set(flat)) != len(flat):
            problems.append(f"{what} buckets {buckets} do not hold each of groups {expected} exactly once")

    cover([e.groups for e in schedule.inputs],
          [i for i, k in enumerate(kinds) if exchanged and k in INPUT_ALL_TO_ALL], "input")
    issues = {e.issue for e in schedule.inputs}
    if len(issues) > 1:
        problems.append(f"input exchanges issued at different points {sorted(issues)}")
    if issues - {schedule.lookup_at, "previous_step"}:
        problems.append(f"input exchanges issued at {sorted(issues)}: at the lookups ({schedule.lookup_at}) or the "
                        f"previous step")
    for e in schedule.inputs:
        if e.packing == "per_tensor" and len(e.groups) > 1:
            problems.append(f"input bucket {e.label}: several groups travel together only byte-packed")
    for op, what in (("all_to_all_single", "output all-to-all"), ("reduce_scatter", "output reduce-scatter")):
        cover([e.groups for e in schedule.outputs if e.op == op],
              [i for i, k in enumerate(kinds) if exchanged and output_collective(k, pooled) == op], what)
    for e in schedule.outputs:
        if e.op == "reduce_scatter" and (len(e.groups) != 1 or e.wait != schedule.lookup_at):
            problems.append(f"output {e.label}: a row-wise reduce-scatter is one group's, waited where it is issued")
        if e.wait not in (schedule.lookup_at, "module_call"):
            problems.append(f"output {e.label} waited at {e.wait}: at the lookups or the module call")
    for e in schedule.outputs:
        if not e.split:
            continue
        region = next((r for r in schedule.regions if r.name == "lookup" and e.groups[0] in r.groups), None)
        if e.op != "all_to_all_single" or len(e.groups) != 1 or not pooled:
            problems.append(f"output {e.label} split per bucket: only one pooled group's all-to-all splits")
        elif region is None or len(region.buckets) != len(e.split):
            problems.append(f"output {e.label} split over {len(e.split)} process groups: its lookup region has "
                            f"{len(region.buckets) if region else 0} buckets")
        if len(set(e.split)) != len(e.split):
            problems.append(f"output {e.label}: buckets share a process group {e.split}")
    for r in schedule.regions:
        if not r.buckets:
            continue
        names = [n for b in r.buckets for n in b]
        if r.name != "lookup" or r.kernel != GENERATED_KERNEL:
            problems.append(f"{r.name} region of {r.groups} ({r.kernel}) has buckets: only a generated lookup runs them")
        if len(r.buckets) < 2 or not all(r.buckets) or len(set(names)) != len(names):
            problems.append(f"lookup region of {r.groups}: buckets {r.buckets} are not two or more disjoint, non-empty "
                            f"sets of tables")
    for role, name in schedule.wire.items():
        if role not in CAST_ROLES or name not in CAST_FORMATS:
            problems.append(f"wire {role}={name}: the runtime casts only {list(CAST_ROLES)} to {sorted(CAST_FORMATS)}")
        elif any(e.split for e in schedule.outputs):
            problems.append(f"wire {role}={name}: pipelined buckets exchange float32 pieces")
    outputs = [r for r in schedule.regions if r.name == "output"]
    if len(outputs) != 1:
        problems.append(f"{len(outputs)} output regions: a module has one")
    elif outputs[0].kernel == CONSUMER_KERNEL and (not pooled or None in kinds):
        problems.append("the consumer layout needs a pooled module whose groups all run on the lifted executor")
    lookups = [g for r in schedule.regions if r.name == "lookup" for g in r.groups]
    if sorted(lookups) != list(range(len(kinds))):
        problems.append(f"lookup regions cover groups {sorted(lookups)}, not each of {list(range(len(kinds)))} once")
    for r in schedule.regions:
        kept = [g for g in r.groups if kinds[g] is None] if all(0 <= g < len(kinds) for g in r.groups) else []
        if kept and (r.name != "lookup" or r.groups != kept or r.kernel != REFERENCE_KERNELS["lookup"] or r.buckets):
            problems.append(f"{r.name} region of {r.groups} ({r.kernel}): group(s) {kept} keep TorchRec's path, "
                            f"whose lookup runs alone on TorchRec's modules")
    return problems
