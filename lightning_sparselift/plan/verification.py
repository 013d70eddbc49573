"""Plans that stay right: the steady-state check of an installed plan against the identity plan,
and the watch on the workload statistics a plan was decided on (drift).

:class:`SteadyStateCheck` schedules a window of real training steps that alternate between the
identity plan (T0) and the installed plan (T1), in pairs; when the plan has a schedule that acts
across steps (the next batch's input distribution starts during the step before), each observed
step is preceded by ``settle_steps`` unmeasured steps on the same plan. The pairs are judged like
calibration's (every rank's pairs gathered, per pair the slowest rank's, signed-rank bounds, outliers
left out: :func:`~lightning_sparselift.cost.calibration.judge_pairs`), and the result is a
:class:`PlanVerification`: predicted, calibrated and measured step change side by side.

:class:`DriftWatch` accumulates, per lifted module and feature, the ids and bags every training
call of the module sees (from the KJT's ``length_per_key`` when it is known, else one small sum
on the device) and its batch sizes; every ``every`` steps the ranks exchange one small tensor and
compare the window with what the plan was decided on (:func:`drift_findings`), so every rank
reaches the same verdict at the same step. :class:`DriftEvent` records what was found and done.

The dataclasses here are plain JSON-able data (a plan file can carry them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch
import torch.distributed as dist

from lightning_sparselift.cost.calibration import PairedSteps

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph

VerificationVerdict = Literal["faster", "slower", "undecided", "incomplete"]


# ---------------------------------------------------------------------------- steady state
@dataclass
class PlanVerification:
    """A plan measured against the identity plan on interleaved real training steps (per step:
    its whole wall time; per pair: the slowest rank's)."""

    steps: int  # training steps the check ran (warmup pair and settle steps included)
    settle_steps: int  # unmeasured steps on the same plan before each observed one
    pairs: int  # measured pairs used (outlier pairs excluded)
    outliers: int  # pairs left out as outliers
    confidence: float
    predicted_ms: Optional[float]  # the step-time model's step change of the plan; None: no model
    calibrated_ms: Optional[float]  # the sum of their calibrated increments; None: not calibrated (e.g. reused)
    measured_ms: Optional[float]  # the plan's step minus the identity plan's (Hodges-Lehmann estimate)
    interval_ms: Optional[list[float]]  # its confidence interval
    noise_ms: Optional[float]  # robust standard deviation of the identity plan's steps
    identity_step_ms: Optional[float]  # median step of the identity plan (slowest rank)
    verdict: VerificationVerdict
    rolled_back: bool  # the identity plan was installed instead
    observations_ms: list[list[float]] = field(default_factory=list)  # per pair: [identity, plan], slowest rank
    note: str = ""

    @property
    def relative_change(self) -> Optional[float]:
        """The measured change as a fraction of the identity plan's step."""
        if self.measured_ms is None or not self.identity_step_ms:
            return None
        return self.measured_ms / self.identity_step_ms

    def describe(self) -> str:
        def ms(x: Optional[float]) -> str:
            return "n/a" if x is None else f"{x:+.3f} ms"

        if self.verdict == "incomplete":
            return f"steady-state check incomplete after {self.steps} step(s): {self.note}"
        low, high = self.interval_ms or [-math.inf, math.inf]
        relative = f" ({self.relative_change:+.1%} of a {self.identity_step_ms:.2f} ms step)" \
            if self.relative_change is not None else ""
        text = (f"steady state vs identity plan: measured {ms(self.measured_ms)} per step{relative}, "
                f"{self.confidence:.0%} interval [{low:+.3f}, {high:+.3f}] over {self.pairs} pairs "
                f"({self.steps} steps, settle {self.settle_steps}, noise "
                f"{self.noise_ms if self.noise_ms is not None else math.nan:.3f} ms"
                + (f", {self.outliers} outlier pair(s) left out" if self.outliers else "")
                + f"); predicted {ms(self.predicted_ms)}, calibrated {ms(self.calibrated_ms)} -> {self.verdict}")
        if self.rolled_back:
            text += "; ROLLED BACK to the identity plan"
        return text + (f"; {self.note}" if self.note else "")


# measured pairs a steady-state check uses at least: its one look's signed-rank bounds exist up to 99% confidence
MIN_VERIFY_PAIRS = 7


class SteadyStateCheck(PairedSteps):
    """The schedule of a steady-state check: T0 the identity plan, T1 the installed plan; about
    ``steps`` steps in all (at least the warmup and :data:`MIN_VERIFY_PAIRS` measured pairs)."""

    def __init__(self, steps: int, settle_steps: int, warmup_pairs: int = 1) -> None:
        super().__init__(warmup_pairs, settle_steps)
        self.measured_pairs = max(MIN_VERIFY_PAIRS, steps // (2 * (1 + settle_steps)) - warmup_pairs)
        self.add_pairs(warmup_pairs + self.measured_pairs)


def settle_steps_for(graph: "SparseGraph") -> int:
    """Unmeasured steps a step of ``graph`` needs after a plan switch: 1 when a module distributes
    the next batch's input during the step before (the first step after a switch runs work the
    other plan started), else 0."""
    return int(any(m.schedule.input_issue == "previous_step" for m in graph.modules))


# ---------------------------------------------------------------------------- drift
@dataclass
class DriftEvent:
    """The workload moved away from what the installed plan was decided on."""

    step: int  # training steps since the session began, when it was found
    findings: list[str]  # what moved, with the statistics
    statistics: dict[str, float]  # "<module>/<feature>/<statistic>" -> value (live and reference)
    action: str  # what the session did: re-planned, deferred, not re-planned, plan file not reused

    def describe(self) -> str:
        return f"workload drift at step {self.step}: {'; '.join(self.findings)} -> {self.action}"


@dataclass
class ModuleWorkload:
    """What a plan is decided on for one lifted module (all ranks together)."""

    ids_per_step: dict[str, float]  # per feature: ids per training step, summed over ranks
    mean_length: dict[str, float]  # per feature: mean bag length
    p99: dict[str, float]  # per feature: 99th percentile bag length (reference only; live: 0)
    batch_size_per_rank: list[int]


def workload_of(graph: "SparseGraph") -> dict[str, ModuleWorkload]:
    """The statistics ``graph`` was lifted with (capture's, or a re-plan's live ones)."""
    out = {}
    for m in graph.modules:
        ids = {k: sum(stats.get(k, 0.0) for stats in m.ids_per_step) for k in m.keys}
        bags = float(sum(m.batch_size_per_rank))
        out[m.path] = ModuleWorkload(ids, {k: ids[k] / bags if bags else 0.0 for k in m.keys},
                                     {k: m.length_percentiles.get(k, {}).get("p99", 0.0) for k in m.keys},
                                     list(m.batch_size_per_rank))
    return out


@dataclass
class Finding:
    module: str
    feature: str  # "" for the batch size
    kind: str  # bag_length, ids_per_step, batch_size
    live: float
    reference: float
    text: str


def drift_findings(reference: dict[str, ModuleWorkload], live: dict[str, ModuleWorkload],
                   ratio: float) -> list[Finding]:
    """What moved beyond ``ratio``: a feature's mean bag length above ``ratio`` x its reference
    p99 (at least 1), a feature's ids per step below 1/``ratio`` of the reference's, or another
    batch size on a rank."""
    found = []
    for path, ref in reference.items():
        now = live.get(path)
        if now is None:
            continue
        for feature, p99 in ref.p99.items():
            mean = now.mean_length.get(feature, 0.0)
            if mean > ratio * max(p99, 1.0):
                found.append(Finding(path, feature, "bag_length", mean, p99,
                                     f"{path} feature {feature}: mean bag length {mean:.2f} > {ratio:g} x the p99 "
                                     f"{p99:.2f} it was planned for (ids per step {now.ids_per_step[feature]:.0f}, "
                                     f"planned {ref.ids_per_step[feature]:.0f})"))
                continue
            ids, planned = now.ids_per_step.get(feature, 0.0), ref.ids_per_step[feature]
            if planned > 0 and ids * ratio < planned:
                found.append(Finding(path, feature, "ids_per_step", ids, planned,
                                     f"{path} feature {feature}: {ids:.1f} ids per step < 1/{ratio:g} of the "
                                     f"{planned:.1f} it was planned for (mean bag length {mean:.2f})"))
        if now.batch_size_per_rank != ref.batch_size_per_rank:
            found.append(Finding(path, "", "batch_size", float(sum(now.batch_size_per_rank)),
                                 float(sum(ref.batch_size_per_rank)),
                                 f"{path}: batch size per rank {now.batch_size_per_rank}, planned for "
                                 f"{ref.batch_size_per_rank}"))
    return found


def finding_statistics(findings: list[Finding]) -> dict[str, float]:
    stats = {}
    for f in findings:
        key = f"{f.module}/{f.feature}/{f.kind}" if f.feature else f"{f.module}/{f.kind}"
        stats[key] = f.live
        stats[f"{key}/planned"] = f.reference
    return stats


class DriftWatch:
    """The live workload of the lifted modules' training calls, checked every ``every`` steps
    against ``reference`` (the graph whose statistics the installed plan was decided on)."""

    def __init__(self, reference: "SparseGraph", rank: int, world: int, every: int, ratio: float) -> None:
        self.reference_graph = reference
        self.reference = workload_of(reference)
        self.rank, self.world, self.every, self.ratio = rank, world, every, ratio
        self.keys = {m.path: list(m.keys) for m in reference.modules}
        self.planned_batch = {m.path: m.batch_size_per_rank[rank] for m in reference.modules}
        self.steps = 0  # steps ended since the watch began
        self._reset()

    def _reset(self) -> None:
        self._window = 0
        self._ids_list: dict[str, list[int]] = {p: [0] * len(k) for p, k in self.keys.items()}
        self._ids_tensor: dict[str, Optional[torch.Tensor]] = {p: None for p in self.keys}
        self._bags = {p: 0 for p in self.keys}
        self._calls = {p: 0 for p in self.keys}
        self._other_batch = {p: 0 for p in self.keys}  # calls with another batch size than planned
        self._last_batch = {p: self.planned_batch[p] for p in self.keys}
        self._last: dict[str, Any] = {}  # the last call's KJT (for new reference statistics)

    def observe(self, path: str, kjt: Any) -> None:
        """One training call of module ``path`` with ``kjt``; cheap: no device sync."""
        if path not in self.keys:
            return
        batch = kjt.stride()
        per_key = kjt.length_per_key_or_none()
        if per_key is not None:
            ids = self._ids_list[path]
            for i, n in enumerate(per_key):
                ids[i] += int(n)
        elif kjt.lengths().numel():
            sums = kjt.lengths().view(len(self.keys[path]), -1).sum(1).to(torch.float64)
            previous = self._ids_tensor[path]
            self._ids_tensor[path] = sums if previous is None else previous + sums
        self._bags[path] += batch
        self._calls[path] += 1
        if batch != self.planned_batch[path]:
            self._other_batch[path] += 1
        self._last_batch[path] = batch
        self._last[path] = kjt

    def end_step(self) -> bool:
        """A training step ended; True when the window is complete (check now, on every rank)."""
        self.steps += 1
        self._window += 1
        return self._window >= self.every

    def check(self, group: Any, device: torch.device) -> tuple[list[Finding], dict[str, ModuleWorkload]]:
        """Compare the window with the reference (one small all-gather over ``group``), then start
        a new window. Every rank returns the same findings."""
        rows = []
        for path, keys in self.keys.items():
            ids = torch.tensor(self._ids_list[path], dtype=torch.float64)
            if self._ids_tensor[path] is not None:
                ids = ids + self._ids_tensor[path].cpu()
            everything_other = self._calls[path] > 0 and self._other_batch[path] == self._calls[path]
            batch = self._last_batch[path] if everything_other else self.planned_batch[path]
            rows.append(torch.cat([ids, torch.tensor([self._bags[path], batch], dtype=torch.float64)]))
        local = torch.cat(rows).to(device)
        if self.world > 1:
            gathered = [torch.empty_like(local) for _ in range(self.world)]
            dist.all_gather(gathered, local, group=group)
            table = torch.stack(gathered).cpu()
        else:
            table = local.cpu().unsqueeze(0)
        steps = max(self._window, 1)
        live, offset = {}, 0
        for path, keys in self.keys.items():
            block = table[:, offset:offset + len(keys) + 2]
            offset += len(keys) + 2
            ids = block[:, :len(keys)].sum(0)
            bags = float(block[:, len(keys)].sum())
            live[path] = ModuleWorkload({k: float(ids[i]) / steps for i, k in enumerate(keys)},
                                        {k: float(ids[i]) / bags if bags else 0.0 for i, k in enumerate(keys)},
                                        {k: 0.0 for k in keys}, [int(b) for b in block[:, len(keys) + 1].tolist()])
        self._reset_keep_last()
        return drift_findings(self.reference, live, self.ratio), live

    def _reset_keep_last(self) -> None:
        last = self._last
        self._reset()
        self._last = last

    def live_graph(self, identity: "SparseGraph", group: Any) -> "SparseGraph":
        """``identity`` with the statistics of each module's last training call (ids per step per
        rank, bag length percentiles of rank 0, batch size per rank): what a new planning round
        decides on. A collective over ``group`` (every rank gets the same graph)."""
        from lightning_sparselift.frontend.capture import _PERCENTILES

        mine = {}
        for path, keys in self.keys.items():
            kjt = self._last.get(path)
            if kjt is None:
                continue
            lengths = kjt.lengths().detach().view(len(keys), -1).cpu().to(torch.float64)
            percentiles = {}
            for i, k in enumerate(keys):
                row = lengths[i]
                percentiles[k] = ({f"p{p}": float(torch.quantile(row, p / 100)) for p in _PERCENTILES}
                                  if row.numel() else {f"p{p}": 0.0 for p in _PERCENTILES})
            mine[path] = {"ids": {k: float(lengths[i].sum()) for i, k in enumerate(keys)},
                          "percentiles": percentiles, "batch": int(kjt.stride())}
        if self.world > 1:
            everyone: list[Any] = [None] * self.world
            dist.all_gather_object(everyone, mine, group=group)
        else:
            everyone = [mine]
        graph = identity.copy()
        for m in graph.modules:
            if not all(m.path in stats for stats in everyone):
                continue
            m.ids_per_step = [stats[m.path]["ids"] for stats in everyone]
            m.length_percentiles = everyone[0][m.path]["percentiles"]
            m.batch_size_per_rank = [stats[m.path]["batch"] for stats in everyone]
        return graph


def check_steady_options(verify_steps: int, drift_ratio: float, min_steps_between_replans: int,
                         drift_check_every: int) -> None:
    """ValueError naming the first steady-state option out of its range."""
    if int(verify_steps) < 0:
        raise ValueError(f"verify_steps must be >= 0 (0: no steady-state check), got {verify_steps}")
    if not float(drift_ratio) > 1:
        raise ValueError(f"drift_ratio must be > 1, got {drift_ratio}")
    if int(min_steps_between_replans) < 0:
        raise ValueError(f"min_steps_between_replans must be >= 0, got {min_steps_between_replans}")
    if int(drift_check_every) < 1:
        raise ValueError(f"drift_check_every must be >= 1, got {drift_check_every}")
