"""What the non-finite step check costs per step: one SparseLift run on 2 ranks (every feasible
pass applied without calibration, as ``calibrate=False`` installs them), its steps run as the
strategy runs them (inspect the batch, forward, the verdict's all-gather on a process group of
its own, backward through each lifted module's update guard, the check before the optimizer
step), in mirrored runs of ``--run`` steps against

- ``--compare check``: the same steps without the check (inspect and verdict not called, so the
  guard and the check before the step return at once), or
- ``--compare guard``: the check with the executors' update guard switched off (the
  check before the optimizer step still raises; what the guard adds to backward).

The measured steps' wall time, training thread CPU and process CPU, as paired differences.

    .venv/bin/python benchmarks/step_check_cost.py --scenario dlrm --compare check --pairs 90
    .venv/bin/python benchmarks/step_check_cost.py --scenario dlrm --compare guard --pairs 90
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from two_ranks import bench_env, mirrored_steps, print_pairs, spawn, warmed_up


class CheckedSteps:
    """The bench system's steps with the strategy's step check around them (``checked``)."""

    def __init__(self, system: object) -> None:
        from lightning_sparselift.lightning.step_check import StepCheck

        self.system, self.session = system, system.session
        self.check = StepCheck(dist.new_group(backend="gloo"), "raise", self.session.model, self.session.paths)
        self.session.installed.guard_updates(self.check.before_update)
        self.checked = True

    def step(self, position: int) -> None:
        env, session = self.system.env, self.session
        batch = env.local_batch(position)
        session.begin_step(batch, env.local_batch(position + 1))
        if self.checked:
            self.check.inspect(batch)
        loss, _ = self.system.model(batch)
        if self.checked:
            loss = self.check.verdict(loss, position, position)
        loss.backward()
        self.check.before_update()
        self.system.optimizer.step()
        self.system.optimizer.zero_grad()
        session.end_step()


def _worker(rank: int, scenario: str, compare: str, pairs: int, run: int) -> None:
    from lightning_sparselift.bench.systems.sparselift import SparseLift
    from lightning_sparselift.runtime.update_guard import no_check

    system = SparseLift(bench_env(rank, scenario), {"calibrate": False})
    step = warmed_up(system)
    steps = CheckedSteps(system)
    installed = system.session.installed

    def use(second: bool) -> None:
        if compare == "check":
            steps.checked = second
        else:
            installed.guard_updates(steps.check.before_update if second else no_check)

    local = mirrored_steps(steps, step, pairs, run, use)
    if rank == 0:
        plan = [d.candidate for d in system.session.plan.decisions if d.accepted]
        print(f"{scenario}: plan {plan}; {local.shape[1]} pairs in runs of {run}; compare {compare}")
    print_pairs(local, *(("no check", "check") if compare == "check" else ("no guard", "guard")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="dlrm")
    parser.add_argument("--compare", choices=("check", "guard"), default="check")
    parser.add_argument("--pairs", type=int, default=90)
    parser.add_argument("--run", type=int, default=4, help="steps per run of one setting (>= 2)")
    args = parser.parse_args()
    if args.run < 2:
        parser.error("--run must be >= 2 (its first step is not measured)")
    spawn(_worker, args.scenario, args.compare, args.pairs, args.run)


if __name__ == "__main__":
    main()
