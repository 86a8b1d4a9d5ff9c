"""gpu_check: a small hybrid model over a paged KV cache, compared bit for bit across cache modes.

Modules: `kernels` (batch-invariant and naive torch kernels), `triton_kernels`
(CUDA paged attention; triton imported lazily), `hybrid` (the model and its
paged storage), `workload` (seeded sessions, replayed into the scheduler loop
of `invariants.simulate.loop`), `forward_pass` (the model over the target's
block ids, as that loop's executor), `runner` (the equivalence check),
`mutants` (negative controls), `bench`, `cli` (`kvretain gpu-check`).
Importing this package imports nothing heavy.
"""
