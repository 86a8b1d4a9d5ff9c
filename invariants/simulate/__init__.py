"""Block-level serving simulator and capacity planner over any allocator target.

`engine` drives a target with a chunked-prefill scheduler loop, `scenarios`
re-creates the seeds' workloads, `settings` names the retention settings
compared, `verdicts` judges each seed claim. The commands live in
`invariants.cli.simulate`.
"""
