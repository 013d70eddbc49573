"""``sparselift plan``: execution plan files (``plan_path=``) for people.

    sparselift plan explain PLAN.json        decisions, predictions, measurements; each module's
                                             schedule and the step's collectives
    sparselift plan diff A.json B.json       what differs: fingerprint fields, decisions,
                                             per-module schedules, provenance, calibration

``diff`` exits 0 when the plans are identical, 1 when they differ; both exit 2 when a file is not
a plan this version reads (the reason, without a traceback). The functions here return text, so
they are used without a subprocess too: :func:`explain`, :func:`diff`, :func:`main`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, TextIO

from lightning_sparselift.ir.schedule import ModuleSchedule
from lightning_sparselift.plan.types import Decision, ExecutionPlan, PlanFileError

# exit statuses of ``sparselift plan diff`` (``explain``: 0, or BAD_FILE)
IDENTICAL, DIFFERENT, BAD_FILE = 0, 1, 2


def explain(plan: ExecutionPlan) -> str:
    """The plan's own explanation (decisions, predictions, measurements) followed by its graph's
    (each module's groups and schedule, then the step's collectives in issue order)."""
    return plan.explain() + "\n\n" + plan.graph.explain()


# ------------------------------------------------------------------------------------------- diff
@dataclass
class PlanDiff:
    """The differences between plan ``a`` and plan ``b``, by section (sections without any are
    absent); each entry is one line for a person."""

    a_name: str
    b_name: str
    sections: dict[str, list[str]] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return not self.sections

    @property
    def count(self) -> int:
        return sum(len(lines) for lines in self.sections.values())

    def text(self) -> str:
        if self.identical:
            return f"plans {self.a_name} and {self.b_name} are identical"
        lines = [f"--- A: {self.a_name}", f"+++ B: {self.b_name}"]
        for title, entries in self.sections.items():
            lines.append(f"{title}:")
            lines += [f"  {e}" for e in entries]
        lines.append(f"{self.count} difference(s)")
        return "\n".join(lines)


def _ms(x: Optional[float]) -> str:
    return "none" if x is None else f"{x:+.3f} ms"


def _observations(obs: Any) -> str:
    """Per rank, each measured pair's increment T1 - T0 (pairs stored as [T0, T1]), as ``explain``
    shows them."""
    if obs is None:
        return "none"
    return "[" + "; ".join(f"rank {r}: " + ", ".join(f"{t1 - t0:+.3f}" for t0, t1 in per_rank)
                           for r, per_rank in enumerate(obs)) + "]"


def _value(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if name == "observations_ms":
        return _observations(value)
    if name.endswith("_ms") and isinstance(value, (int, float)):  # increments signed, other times not
        return _ms(value) if name in ("predicted_ms", "measured_ms") else f"{value:.3f} ms"
    if name.endswith("_ms") and isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
        return "[" + ", ".join(f"{v:+.3f}" for v in value) + "] ms"
    return str(value)


def _changed(what: str, a: Any, b: Any, show: Callable[[Any], str] = str) -> Optional[str]:
    """``what: a -> b`` when the values differ (shown with more digits when ``show`` rounds them equal)."""
    if a == b:
        return None
    sa, sb = show(a), show(b)
    if sa == sb:
        sa, sb = repr(a), repr(b)
    return f"{what}: {sa} -> {sb}"


def verdict(d: Decision) -> str:
    return "ACCEPT" if d.accepted else ("reject" if d.feasible else "infeasible")


def _decision_summary(d: Decision) -> str:
    measured = f", measured {_ms(d.measured_ms)}" if d.measured_ms is not None else ""
    predicted = f"predicted {_ms(d.predicted_ms)}" if d.predicted_ms is not None else "no prediction"
    return f"{verdict(d)}, {predicted}{measured}; {d.reason}"


def _fingerprint(a: ExecutionPlan, b: ExecutionPlan) -> list[str]:
    out = []
    fa, fb = asdict(a.fingerprint), asdict(b.fingerprint)
    for name in fa:
        if name == "versions":
            for lib in sorted(set(fa[name]) | set(fb[name])):
                line = _changed(f"versions.{lib}", fa[name].get(lib, "absent"), fb[name].get(lib, "absent"))
                if line:
                    out.append(line)
        else:
            line = _changed(name, fa[name], fb[name])
            if line:
                out.append(line)
    if a.schema != b.schema:
        out.append(f"schema: {a.schema} -> {b.schema}")
    return out


# fields named by the candidate id, or summarized by the verdict, or restating the others (reason)
_DECISION_NOT_COMPARED = ("candidate", "pass_name", "module", "role", "feasible", "accepted", "reason")
_DECISION_LABELS = {"predicted_ms": "predicted", "measured_ms": "measured", "interval_ms": "interval",
                    "observations_ms": "observations (ms)", "noise_ms": "noise"}


def _split(a: dict, b: dict) -> tuple[list, list, list]:
    """The keys only in ``a``, only in ``b``, and in both (each in its dict's order)."""
    return [k for k in a if k not in b], [k for k in b if k not in a], [k for k in a if k in b]


def _decisions(a: ExecutionPlan, b: ExecutionPlan) -> list[str]:
    out = []
    da, db = {d.candidate: d for d in a.decisions}, {d.candidate: d for d in b.decisions}
    only_a, only_b, both = _split(da, db)
    out += [f"- {cid} (only in A): {_decision_summary(da[cid])}" for cid in only_a]
    out += [f"+ {cid} (only in B): {_decision_summary(db[cid])}" for cid in only_b]
    for cid in both:
        x, y = da[cid], db[cid]
        # the verdict, then every other recorded field (predicted, measured, observations, ...) by name
        fx, fy = asdict(x), asdict(y)
        changes = [_changed("verdict", verdict(x), verdict(y))]
        first = list(_DECISION_LABELS)  # these first, in this order; then the rest in field order
        names = sorted((k for k in fx if k not in _DECISION_NOT_COMPARED),
                       key=lambda k: first.index(k) if k in first else len(first))
        changes += [_changed(_DECISION_LABELS.get(k, k), fx[k], fy.get(k), lambda v, k=k: _value(k, v))
                    for k in names]
        changes = [c for c in changes if c]
        if not changes:  # the reason mostly restates the verdict and measurement; shown when nothing else changed
            changes = [c for c in (_changed("reason", x.reason, y.reason, repr),) if c]
        if changes:
            out.append(f"~ {cid}: " + "; ".join(changes))
    order_a = [d.candidate for d in a.accepted]
    order_b = [d.candidate for d in b.accepted]
    if order_a != order_b and sorted(order_a) == sorted(order_b):
        out.append(f"accepted in another order (passes apply in it): {order_a} -> {order_b}")
    return out


def _buckets(schedule: ModuleSchedule, which: str) -> dict[str, dict[str, Any]]:
    exchanges = schedule.inputs if which == "input" else schedule.outputs
    # what the bucket does first (packing and issue point, or op and wait point), then where it runs
    order = lambda k: (k in ("process_group", "stream"), k == "stream")  # noqa: E731
    return {e.label: {k: v for k, v in sorted(asdict(e).items(), key=lambda kv: order(kv[0])) if k != "groups"}
            for e in exchanges}


def _bucket_text(fields: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in fields.items() if v is not None)


def _schedule(a: ModuleSchedule, b: ModuleSchedule) -> list[str]:
    out = []
    line = _changed("lookup_at", a.lookup_at, b.lookup_at)
    if line:
        out.append(line)
    for which in ("input", "output"):
        ba, bb = _buckets(a, which), _buckets(b, which)
        only_a, only_b, both = _split(ba, bb)
        out += [f"{which} {label}: only in A ({_bucket_text(ba[label])})" for label in only_a]
        out += [f"{which} {label}: only in B ({_bucket_text(bb[label])})" for label in only_b]
        for label in both:
            changes = [c for c in (_changed(k, v, bb[label][k]) for k, v in ba[label].items()) if c]
            if changes:
                out.append(f"{which} {label}: " + "; ".join(changes))
    ra = {(r.name, tuple(r.groups)): r.kernel for r in a.regions}
    rb = {(r.name, tuple(r.groups)): r.kernel for r in b.regions}
    for key in list(ra) + [k for k in rb if k not in ra]:
        name = key[0] + (f"[{'+'.join(f'g{g}' for g in key[1])}]" if key[1] else "")
        if key not in rb:
            out.append(f"region {name}: only in A (kernel {ra[key]})")
        elif key not in ra:
            out.append(f"region {name}: only in B (kernel {rb[key]})")
        elif ra[key] != rb[key]:
            out.append(f"region {name}: kernel {ra[key]} -> {rb[key]}")
    return out


def _modules(a: ExecutionPlan, b: ExecutionPlan) -> list[str]:
    out = []
    ma, mb = {m.path: m for m in a.graph.modules}, {m.path: m for m in b.graph.modules}
    out += [f"module {p}: only in A" for p in ma if p not in mb]
    out += [f"module {p}: only in B" for p in mb if p not in ma]
    for path, x in ma.items():
        y = mb.get(path)
        if y is None:
            continue
        kinds_x, kinds_y = [g.sharding_type for g in x.groups], [g.sharding_type for g in y.groups]
        if kinds_x != kinds_y:
            out.append(f"{path}: sharding groups {kinds_x} -> {kinds_y}")
        elif x.groups != y.groups:
            fields = sorted({k for gx, gy in zip(x.groups, y.groups) for k, v in asdict(gx).items()
                             if v != asdict(gy)[k]})
            out.append(f"{path}: sharding groups' {', '.join(fields)} differ")
        out += [f"{path}: {line}" for line in _schedule(x.schedule, y.schedule)]
        # what capture saw (statistics, where the input is): not decisions, but not the same plan either
        dx, dy = asdict(x), asdict(y)
        other = [k for k in dx if k not in ("path", "groups", "schedule") and dx[k] != dy[k]]
        if other:
            out.append(f"{path}: captured {', '.join(other)} differ")
    ga, gb = asdict(a.graph), asdict(b.graph)
    graph_fields = [k for k in ga if k not in ("modules", "provenance") and ga[k] != gb[k]]
    if graph_fields:
        out.append(f"graph {', '.join(graph_fields)} differ")
    return out


def _provenance(a: ExecutionPlan, b: ExecutionPlan) -> list[str]:
    pa, pb = a.graph.provenance, b.graph.provenance
    out = [f"- {p}" for p in pa if p not in pb] + [f"+ {p}" for p in pb if p not in pa]
    if not out and pa != pb:
        out.append(f"the same passes in another order: {pa} -> {pb}")
    return out


def _calibration(a: ExecutionPlan, b: ExecutionPlan) -> list[str]:
    lines = [
        _changed("calibration steps", a.calibration_steps, b.calibration_steps),
        _changed("calibration time", a.calibration_s, b.calibration_s, lambda s: f"{s:.2f} s"),
        _changed("planning time", a.planning_s, b.planning_s, lambda s: f"{s:.3f} s"),
        _changed("predicted change", a.predicted_change_ms, b.predicted_change_ms,
                 lambda ms: "none" if ms is None else f"{ms:+.3f} ms"),
    ]
    return [line for line in lines if line]


def diff(a: ExecutionPlan, b: ExecutionPlan, a_name: str = "A", b_name: str = "B") -> PlanDiff:
    """What differs from plan ``a`` to plan ``b``: fingerprint fields by name, decisions (only in
    one, or changed verdict, prediction, measurement, reason), per-module sharding groups and
    schedules (lookup point; input and output buckets with their packing or op, issue or wait
    point, process group and stream; each region's kernel), provenance (the passes applied) and
    calibration (steps, time, the model's predicted change)."""
    result = PlanDiff(a_name, b_name)
    for title, lines in (("fingerprint", _fingerprint(a, b)), ("decisions", _decisions(a, b)),
                         ("schedules", _modules(a, b)), ("provenance", _provenance(a, b)),
                         ("calibration", _calibration(a, b))):
        if lines:
            result.sections[title] = lines
    return result


# ------------------------------------------------------------------------------------------- command
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparselift plan",
                                     description="Read SparseLift execution plan files (plan_path=).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{explain,diff}")
    p = commands.add_parser("explain", help="what the plan decided and why; each module's schedule and the step")
    p.add_argument("plan", metavar="PLAN.json")
    p = commands.add_parser("diff", help="what differs between two plans (exit 0: identical, 1: they differ)")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    return parser


def main(argv: Optional[list[str]] = None, out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    """``sparselift plan ...``; the exit status (usage errors exit 2 through argparse)."""
    out, err = out or sys.stdout, err or sys.stderr
    args = _parser().parse_args(argv)
    plans = []
    for path in [args.plan] if args.command == "explain" else [args.a, args.b]:
        try:
            plans.append(ExecutionPlan.load(path))
        except PlanFileError as error:
            where = "" if str(path) in str(error) else f"{path}: "  # (read errors name the file already)
            print(f"sparselift plan: error: {where}{error}", file=err)
            return BAD_FILE
    if args.command == "explain":
        print(explain(plans[0]), file=out)
        return 0
    a, b = plans
    result = diff(a, b, args.a, args.b)
    print(result.text(), file=out)
    return IDENTICAL if result.identical else DIFFERENT
