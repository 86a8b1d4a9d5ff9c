"""Block-level serving simulator over any allocator target (issue 7).

`add_parser(subparsers)` registers `kvretain simulate` and `kvretain plan`;
`run_simulate(args)` / `run_plan(args)` implement them.
"""

from invariants.simulate.cli import add_parser, run_plan, run_simulate

__all__ = ["add_parser", "run_plan", "run_simulate"]
