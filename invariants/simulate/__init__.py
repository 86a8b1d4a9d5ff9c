"""Block-level serving simulator and capacity planner over any allocator target.

`loop` is the one scheduler loop (continuous batching, chunked prefill,
preemption) with its observers, shared with gpu_check; `tokens` draws the
simulator's prompts and samples; `scenarios` re-creates the seeds' workloads,
`settings` names the retention settings compared, `verdicts` judges each seed
claim. The commands live in `invariants.cli.simulate`.
"""
