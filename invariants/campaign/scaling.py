"""The explore campaign's scaling figure: states/s with 1 worker and with N, in one run.

    python -m invariants.campaign.scaling [--target model] [--instance full-p5-r2] [--depth 5]
                                          [--workers 2] [--ray local:2]

Searches the same instance in one process (`invariants.explore.search`), then
on Ray with 1 worker and with N (`invariants.campaign.explore`), checks that
the three certificates count the same states at every depth, and prints each
run's states/s and the ratios: by wall clock, and by the workers' CPU time (per
depth the busiest worker's CPU seconds, summed: the wall time on dedicated
cores, which a machine shared with other work does not show). The workers are started, and have imported the
target, before each timed search (as the one-process search runs in a process
that has); the Ray instance's start is not timed either.
"""

from __future__ import annotations

import argparse
import sys

from invariants.campaign import connect
from invariants.campaign.explore import Driver, explore_on_ray
from invariants.explore.instances import features_of, grid_by_name
from invariants.explore.search import Limits, explore
from invariants.targets import TARGET_NAMES, target_factory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m invariants.campaign.scaling", description=__doc__)
    p.add_argument("--target", choices=TARGET_NAMES, default="model")
    p.add_argument("--instance", default="full-p5-r2")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ray", default=None, help="Ray address (default local:WORKERS)")
    args = p.parse_args(argv)
    factory = target_factory(args.target)
    (instance,) = grid_by_name([args.instance], features_of(factory))
    limits = Limits(args.depth, max_states=10_000_000)
    one = explore(instance, factory, args.target, limits)
    session = connect(args.ray or f"local:{args.workers}")
    rows = [("one process", one)]
    cpu: list[tuple[float, float]] = []
    try:
        for n in (1, args.workers):
            session.workers = n
            driver = Driver(session)
            try:
                driver.start(instance, args.target, limits, None)  # the workers import the target now
                cert = explore_on_ray(session, instance, args.target, limits, driver=driver)
            finally:
                driver.close()
            rows.append((f"Ray, {n} worker(s)", cert))
            cpu.append((driver.critical_cpu_s, driver.total_cpu_s))
    finally:
        session.close()
    same = all(c.new_states == one.new_states and c.transitions == one.transitions for _, c in rows)
    print(
        f"{args.target} {instance.name} depth {args.depth}: states by depth {' '.join(map(str, one.new_states))}"
    )
    for i, (name, c) in enumerate(rows):
        line = f"  {name:<20} {c.states:>8} states {c.seconds:8.1f} s wall {c.states_per_s():8.0f} states/s"
        if i:
            crit, total = cpu[i - 1]
            line += f"; worker CPU {total:.1f} s, busiest worker per depth {crit:.1f} s: {c.states / crit:.0f} states/s"
        print(line)
    ray1, rayn = rows[1][1].states_per_s(), rows[2][1].states_per_s()
    base = one.states_per_s()
    print(
        f"  wall: {args.workers} workers / 1 worker {rayn / ray1:.2f}x; 1 worker / one process {ray1 / base:.2f}x; "
        f"certificates equal: {'yes' if same else 'NO'}"
    )
    print(
        f"  CPU critical path (dedicated cores, Ray's own daemons aside): {args.workers} workers / 1 worker "
        f"{cpu[0][0] / cpu[1][0]:.2f}x; work added by partitioning {cpu[1][1] / cpu[0][1]:.2f}x"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
