"""The step-time model: what a training step of any schedule the passes can write costs, from the
lifted graph and a few measured inputs. One model: the planner's predictions (a candidate's
increment is the model's step with it applied minus without, so every combination has one too),
``explain()`` and the bench's "predicted" column all read :meth:`StepModel.predict`.

Inputs (:class:`~.step_record.StepModelInputs`, recorded in the plan file):

- the capture steps, each rank on its own clock: the step's wall time and, per sparse module,
  the dense compute between the root forward's start and the module's call (the window an early
  start overlaps; backward's is taken as ``backward_ratio`` times it: autograd replays that
  compute at about twice its forward cost);
- collectives: alpha-beta per process group (the all-to-all micro-benchmark of
  :mod:`.priors`, slowest rank; a pipelined bucket's group spans the same ranks and takes the
  world group's), priced at the member that puts in the most bytes;
- compute: bytes over the measured copy bandwidth, per region and kernel (:data:`PASSES`); the
  lookups' terms scaled per rank so that TorchRec's (the reference kernels) add up to what the
  capture steps measured of its lookup modules, and spread over ``min(buckets, threads, cores)``;
  TorchRec's input regions, where a generated kernel can replace them, as :mod:`~lightning_sparselift.session.input_probe`
  timed them on the module's shape.

The step is simulated per module and rank, forward then backward: compute advances the rank's
clock; a collective waited where it is issued ends at the slowest rank's arrival plus its
alpha-beta time (the slowest rank gates it); one issued early and waited later ends at
``max(own clock, that)`` after the dense window in between ran. The prediction is the captured
step plus the simulated sparse path's change from the identity plan, on the slowest rank.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from lightning_sparselift.cost.priors import AlphaBeta, Priors
from lightning_sparselift.cost.step_record import StepModelInputs, StepModelRecord, StepPrediction, StepTimings
from lightning_sparselift.ir.schedule import CONSUMER_KERNEL, GENERATED_KERNEL, INPUT_REGIONS
from lightning_sparselift.ir.steps import CollectiveNode, ComputeNode
from lightning_sparselift.ir.vocab import BACKWARD_OF, DTYPE_BYTES, WIRE_FORMATS

if TYPE_CHECKING:
    from lightning_sparselift.ir import LiftedModule, SparseGraph

# passes over a region's bytes (each a read and a write at the copy bandwidth), by region and
# kernel. Input regions: TorchRec derives per-key sums and offsets in passes of their own beside
# the move, the generated kernel in the move. Lookup backward: fbgemm's serial CPU loop reads each
# touched row's gradient and weights about twice (sort, then accumulate and update), the generated
# one once. Output: TorchRec's KeyedTensor -> dict -> the model's cat, and in backward the split
# and the output distribution's packing, copy the pooled block four times; the consumer layout
# writes it once, in place.
PASSES = {("input", "reference"): 2.0, ("input", GENERATED_KERNEL): 1.0,
          ("lookup_forward", "any"): 0.5,
          ("lookup_backward", "reference"): 2.0, ("lookup_backward", GENERATED_KERNEL): 1.0,
          ("output", "reference"): 4.0, ("output", CONSUMER_KERNEL): 0.0,
          ("pack", "bytes"): 2.0,
          # a wire format narrower than float32 (encode and decode, over the float32 bytes): TorchRec's
          # codecs in calls of their own (FP16: a clamp, then the cast); the communication-precision
          # pass's cast in the layouts' packing copies where they make them (a merged exchange, priced
          # above), on the receiving side in the consumer layout's copy when both directions are cast,
          # else in a pass of its own
          ("wire", "codec"): 2.0, ("wire", "cast"): 1.0, ("wire", "consumer"): 0.5, ("wire", "merged"): 0.0}
_PART = {"lookup": "lookup_forward", "fused_update": "lookup_backward"}  # the lookup's compute nodes


class StepModel:
    """The model of one run: its inputs, and the identity graph whose captured step the
    predictions start from."""

    def __init__(self, inputs: StepModelInputs, identity: SparseGraph) -> None:
        self.inputs = inputs
        self.identity = identity
        self.backend_ms_per_byte = self._backend_rate(identity)

    @classmethod
    def measure(cls, priors: Priors, timings: StepTimings, identity: SparseGraph,
                reference_input_ms: dict[str, list[float]]) -> "StepModel":
        """From this run's machine constants (:func:`~.priors.measure_priors`), capture steps and
        TorchRec's input kernels on the graph's shapes (:func:`~lightning_sparselift.session.input_probe.measure_reference_inputs`)."""
        return cls(StepModelInputs(timings, [priors.all_to_all], priors.lookup.bandwidth_bytes_per_ms,
                                   priors.cores_per_rank, reference_input_ms=reference_input_ms), identity)

    @cached_property
    def _base(self) -> tuple[float, float, float, float, float]:
        """The identity graph's sparse path, which predictions are differences from (simulated at
        the first prediction: :meth:`reference_lookup_ms` needs none)."""
        return self._simulate(self.identity)

    def predict(self, graph: SparseGraph) -> StepPrediction:
        forward, backward, collectives, hidden, compute = self._simulate(graph)
        step = max(self.inputs.timings.step_ms, default=0.0) + (forward + backward) - (self._base[0] + self._base[1])
        return StepPrediction(step, forward, backward, collectives, hidden, compute)

    def increment_ms(self, before: SparseGraph, after: SparseGraph) -> float:
        """The step change from ``before`` to ``after`` (the sparse path's: the rest is the same)."""
        return self.increments_ms(before, [after])[0]

    def increments_ms(self, before: SparseGraph, afters: list[SparseGraph]) -> list[float]:
        """:meth:`increment_ms` from ``before`` to each of ``afters``."""
        b = self._simulate(before)
        return [a[0] + a[1] - (b[0] + b[1]) for a in map(self._simulate, afters)]

    def record(self, plan: SparseGraph) -> StepModelRecord:
        return StepModelRecord(self.inputs, self.predict(self.identity), self.predict(plan))

    # ------------------------------------------------------------------ simulation
    def link(self, process_group: str) -> AlphaBeta:
        """The alpha-beta of ``process_group`` (a bucket's group spans the world's ranks: the world's)."""
        for link in self.inputs.links:
            if link.process_group == process_group:
                return link
        return self.inputs.links[0]

    def _backend_rate(self, identity: SparseGraph) -> float:
        """The collectives' backend CPU per byte a rank puts in, where it takes the training
        thread's core (fewer than 2 cores per rank): what the capture steps measured beyond the
        training thread over the identity step's bytes, the busiest rank's; else 0."""
        measured = self.inputs.timings.backend_cpu_ms
        if self.inputs.cores_per_rank >= 2 or not measured:
            return 0.0
        nodes = identity.collectives()
        rates = [ms / total for r, ms in enumerate(measured)
                 if (total := sum(n.bytes_per_member[r] for n in nodes if r < len(n.bytes_per_member))) > 0]
        return max(rates, default=0.0)

    def reference_lookup_ms(self, graph: SparseGraph) -> dict[str, list[float]]:
        """Per sparse module, per rank: the byte model's ms of TorchRec's lookups on ``graph``
        (before the captured lookups scale them)."""
        return {m.path: _ModuleSimulation(self, graph, m, [n for n in graph.nodes if n.module == m.path])
                .reference_lookup_ms() for m in graph.modules}

    def copy_ms(self, nbytes: float, passes: float) -> float:
        """``passes`` reads and writes of ``nbytes`` at the copy bandwidth."""
        return passes * 2 * nbytes / max(self.inputs.bandwidth_bytes_per_ms, 1e-9)

    def _simulate(self, graph: SparseGraph) -> tuple[float, float, float, float, float]:
        """(forward, backward, collectives, hidden, compute) ms of the sparse path, summed over
        modules, each the slowest rank's."""
        nodes = graph.nodes
        totals = [0.0] * 5
        for m in graph.modules:
            mine = [n for n in nodes if n.module == m.path]
            for i, value in enumerate(_ModuleSimulation(self, graph, m, mine).run()):
                totals[i] += value
        return tuple(totals)


class _ModuleSimulation:
    """One module's sparse forward and backward, per rank: each rank's clock from the root
    forward's start (forward) and from the module output's gradient (backward), the dense compute
    of the window included."""

    def __init__(self, model: StepModel, graph: SparseGraph, m: LiftedModule, nodes: list[Any]) -> None:
        self.model, self.graph, self.m, self.nodes = model, graph, m, nodes
        self.world = graph.world_size
        window = model.inputs.timings.window_ms.get(m.path, [])
        self.window = [window[r] if r < len(window) else 0.0 for r in range(self.world)]
        self.collectives = [0.0] * self.world
        self.hidden = [0.0] * self.world
        self.compute = [0.0] * self.world
        self.lookup_ms: dict[int, list[float]] = {}  # per group, per rank: this step's forward lookups
        self.busy: dict[str, float] = {}  # per process group: when its collectives in flight end
        self.ids = {(n.groups[0], n.rank): n.workload["ids"] for n in nodes
                    if isinstance(n, ComputeNode) and n.op == "lookup"}
        self.most_ids = max(sum(stats.values()) for stats in m.ids_per_step)  # the member feeding the most
        self.scale = self._lookup_scale()

    def run(self) -> tuple[float, float, float, float, float]:
        forward = self._forward()
        backward = self._backward()
        # the slowest rank's clocks, beyond the dense compute of the slowest window (what every
        # schedule waits for anyway)
        r = max(range(self.world), key=lambda r: forward[r] + backward[r])
        dense = max(self.window, default=0.0)
        return (forward[r] - dense, backward[r] - self.model.inputs.backward_ratio * dense, self.collectives[r],
                self.hidden[r], self.compute[r])

    # -------------------------------------------------------------- costs
    def _coll_ms(self, node: CollectiveNode) -> float:
        return self.model.link(node.process_group).predict_ms(max(node.bytes_per_member, default=0))

    def _compute_ms(self, node: ComputeNode, rank: int) -> float:
        m, model = self.m, self.model
        if node.op in INPUT_REGIONS:
            kernel = GENERATED_KERNEL if node.kernel == GENERATED_KERNEL else "reference"
            timed = model.inputs.reference_input_ms.get(node.id)
            if kernel == "reference" and timed:
                return timed[rank] + model.inputs.launch_ms
            # (a recat's workload counts keys: it moves what arrived, about the rank's own ids)
            ids = node.workload.get("ids", self.most_ids)
            return model.copy_ms(ids * _id_bytes(m), PASSES[("input", kernel)]) + model.inputs.launch_ms
        if node.op in _PART and node.rank in (None, rank):
            return self._lookup_ms(node, _PART[node.op], rank) + model.inputs.launch_ms
        return 0.0

    def _run(self, node: ComputeNode, clock: list[float]) -> None:
        """``node``'s compute on each rank's clock (a lookup of one rank's shards: on that rank's
        only); a forward lookup's also in its group's lookup time."""
        one = node.op in _PART and node.rank is not None
        lookups = self.lookup_ms.setdefault(node.groups[0], [0.0] * self.world) if node.op == "lookup" else None
        for r in ([node.rank] if node.rank < self.world else []) if one else range(self.world):
            ms = self._compute_ms(node, r)
            clock[r] += ms
            self.compute[r] += ms
            if lookups is not None:
                lookups[r] += ms

    def _lookup_ms(self, node: ComputeNode, part: str, rank: int) -> float:
        """A lookup's forward or its backward with the fused update on ``rank``: its touched rows'
        passes, scaled to the rank's captured lookups, over the buckets that run at once."""
        kernel = GENERATED_KERNEL if node.kernel == GENERATED_KERNEL else "reference"
        return self._passes_ms(node, part, kernel) * self.scale[rank] / self._concurrency(node)

    def _passes_ms(self, node: ComputeNode, part: str, kernel: str) -> float:
        (group,) = node.groups
        dim = max(self.m.groups[group].embedding_dims, default=0)
        # (the fused update touches the rows its forward lookup read)
        ids = self.ids.get((group, node.rank), 0.0)
        return self.model.copy_ms(ids * dim * 4, PASSES.get((part, kernel), PASSES.get((part, "any"))))

    def reference_lookup_ms(self) -> list[float]:
        """Per rank: what the byte model gives TorchRec's lookups of this module (its reference
        kernels), forward and backward."""
        mine = [0.0] * self.world
        everyone = 0.0  # (a data-parallel lookup runs on every rank)
        for n in self.nodes:
            if isinstance(n, ComputeNode) and n.op in _PART:
                ms = self._passes_ms(n, _PART[n.op], "reference")
                if n.rank is None:
                    everyone += ms
                elif n.rank < self.world:
                    mine[n.rank] += ms
        return [ms + everyone for ms in mine]

    def _lookup_scale(self) -> list[float]:
        """Per rank: the captured ms of TorchRec's lookups of this module over what the byte model
        gives its reference kernels (1 where nothing was captured)."""
        measured = self.model.inputs.timings.lookup_ms.get(self.m.path, [])
        if not any(measured):
            return [1.0] * self.world
        out = []
        for r, modelled in enumerate(self.reference_lookup_ms()):
            ms = measured[r] if r < len(measured) else 0.0
            out.append(ms / modelled if ms > 0 and modelled > 0 else 1.0)
        return out

    def _concurrency(self, node: ComputeNode) -> float:
        """How many of a lookup's buckets run at once: concurrent buckets, up to the rank's threads
        and cores (pipelined ones run one after the other)."""
        (group,) = node.groups
        buckets = len(self.m.schedule.region("lookup", group).buckets) or 1
        if buckets == 1 or any(e.split for e in self.m.schedule.outputs if group in e.groups):
            return 1.0
        threads = self.graph.threads_per_rank
        rank_threads = threads[node.rank] if threads and node.rank is not None and node.rank < len(threads) else buckets
        return max(1.0, min(buckets, rank_threads, self.model.inputs.cores_per_rank))

    def _output_ms(self) -> float:
        """The output region's copies of the pooled block, each direction's half."""
        m = self.m
        if not m.pooled:
            return 0.0
        kernel = CONSUMER_KERNEL if m.schedule.region("output").kernel == CONSUMER_KERNEL else "reference"
        pooled = max(m.batch_size_per_rank, default=0) * sum(m.embedding_dims) * 4
        launches = 1 if kernel == CONSUMER_KERNEL else PASSES[("output", kernel)] / 2
        return self.model.copy_ms(pooled, PASSES[("output", kernel)] / 2) + launches * self.model.inputs.launch_ms

    def _pack_ms(self, node: CollectiveNode) -> float:
        """What a collective takes of the training thread's core: packing and unpacking a merged
        collective's buffer (several groups' data in one), encoding and decoding its values when
        they travel narrower than float32, and the backend's CPU for its bytes where the rank has
        no spare core (:meth:`StepModel._backend_rate`)."""
        nbytes = max(node.bytes_per_member, default=0)
        merged = node.role == "input_payload" or (len(node.groups) > 1 and node.role != "input_splits")
        ms = self.model.copy_ms(nbytes, PASSES[("pack", "bytes")]) if merged else 0.0
        ms += self.model.inputs.launch_ms
        ms += nbytes * self.model.backend_ms_per_byte
        wire = self.m.wire_format(node.role)
        if wire:
            s = self.m.schedule
            fused = self.m.pooled and s.region("output").kernel == CONSUMER_KERNEL and s.pooled_wire
            how = "codec" if node.role in self.m.wire else "merged" if merged else "consumer" if fused else "cast"
            ms += self.model.copy_ms(nbytes * 4 / WIRE_FORMATS[wire][1], PASSES[("wire", how)])
        return ms

    def _advance(self, clock: list[float], ms: list[float]) -> list[float]:
        """Compute on each rank's training thread."""
        for r in range(self.world):
            self.compute[r] += ms[r]
        return [c + d for c, d in zip(clock, ms)]

    def _sync(self, clock: list[float], node: CollectiveNode) -> list[float]:
        """A collective waited where it is issued: every rank leaves it when the slowest one arrived,
        plus its time."""
        t = self._coll_ms(node)
        for r in range(self.world):
            self.collectives[r] += t
        return [max(clock) + t] * self.world

    def _issue(self, node: CollectiveNode, clock: list[float]) -> tuple[float, float]:
        """(when it ends, its time) of a collective left in flight: it starts when the slowest rank
        issued it and its process group finished the ones issued before."""
        t = self._coll_ms(node)
        end = max(max(clock), self.busy.get(node.process_group, 0.0)) + t
        self.busy[node.process_group] = end
        return end, t

    def _overlap(self, clock: list[float], ends: list[float], times: list[float], dense: list[float]) -> list[float]:
        """Collectives in flight (ending at ``ends``, taking ``times``) while each rank runs
        ``dense`` ms of dense compute, then waits for them. (On this 2-core machine a
        micro-benchmark of an all-to-all beside matrix products on both ranks hid none of it, yet
        dlrm's early start measured about all of its two all-to-alls hidden: a training step's
        threads block often enough for the collective's copies to run; the model hides all of it.)"""
        out = []
        for r in range(self.world):
            at = clock[r] + dense[r]
            end = max(ends, default=at)
            for t in times:
                self.collectives[r] += t
            self.hidden[r] += max(sum(times) - max(end - at, 0.0), 0.0)
            out.append(max(at, end))
        return out

    # -------------------------------------------------------------- forward
    def _forward(self) -> list[float]:
        s, world = self.m.schedule, self.world
        early = s.lookup_at == "root_forward"
        clock = [0.0] * world if early else list(self.window)
        in_flight: list[tuple[float, float]] = []  # (end, time) of collectives waited at the module call
        for node in (n for n in self.nodes if n.phase == "forward"):
            if isinstance(node, ComputeNode):
                self._run(node, clock)
            elif node.issue == "previous_step":
                # issued a step ahead, on the training thread: its packing, and the splits exchange
                # (the ranks just met in the previous step's call: no wait for the slowest); the
                # payload stays in flight through the rest of that step
                clock = self._advance(clock, [self._pack_ms(node)] * world)
                t = self._coll_ms(node)
                for r in range(world):
                    self.collectives[r] += t
                    if node.role == "input_splits":
                        clock[r] += t
                    else:
                        self.hidden[r] += t
            else:
                clock = self._advance(clock, [self._pack_ms(node)] * world)
                if node.bucket is not None:
                    in_flight.append(self._bucket(node, clock))
                elif node.wait == node.issue:
                    clock = self._sync(clock, node)
                else:
                    in_flight.append(self._issue(node, clock))
        dense = list(self.window) if early else [0.0] * world
        if in_flight:
            clock = self._overlap(clock, [e for e, _ in in_flight], [t for _, t in in_flight], dense)
        elif early:
            clock = [c + d for c, d in zip(clock, dense)]
        return self._advance(clock, [self._output_ms()] * world)

    def _bucket(self, node: CollectiveNode, clock: list[float]) -> tuple[float, float]:
        """A pipelined bucket's all-to-all: issued when its share of the group's lookups is done
        (the buckets taken as equal shares), on a process group of its own."""
        (group,) = node.groups
        buckets = len(self.m.schedule.region("lookup", group).buckets)
        lookups = self.lookup_ms.get(group, [0.0] * self.world)
        issued = [clock[r] - lookups[r] * (buckets - 1 - node.bucket) / buckets for r in range(self.world)]
        return self._issue(node, issued)

    # -------------------------------------------------------------- backward
    def _backward(self) -> list[float]:
        world = self.world
        window = [w * self.model.inputs.backward_ratio for w in self.window]
        clock = self._advance([0.0] * world, [self._output_ms()] * world)
        in_flight: list[tuple[float, float]] = []  # issued where forward waited, waited before the fused update
        self.busy = {}  # (a clock of its own, from the module output's gradient)
        overlapped = False
        for node in (n for n in self.nodes if n.phase == "backward"):
            if isinstance(node, ComputeNode):
                if in_flight:  # the dense backward in between ran meanwhile
                    clock = self._overlap(clock, [e for e, _ in in_flight], [t for _, t in in_flight], window)
                    in_flight, overlapped = [], True
                self._run(node, clock)
            elif node.issue == "ddp_backward":
                continue  # DDP's all-reduces, outside the sparse path
            else:
                clock = self._advance(clock, [self._pack_ms(node)] * world)
                if node.wait == BACKWARD_OF["root_forward"] and node.issue != node.wait:
                    in_flight.append(self._issue(node, clock))
                else:
                    clock = self._sync(clock, node)
        if in_flight:
            clock = self._overlap(clock, [e for e, _ in in_flight], [t for _, t in in_flight], window)
            overlapped = True
        return clock if overlapped else [c + w for c, w in zip(clock, window)]


def _id_bytes(m: LiftedModule) -> float:
    return DTYPE_BYTES[m.values_dtype] + (4 if m.weighted else 0)
