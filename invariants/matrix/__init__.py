"""The release matrix: kvretain's checks on every vLLM release since the seeds'
mechanisms landed, each release in its own cached environment, every
disagreement classified (`classify`), failures shrunk within the budget
(`shrink`); `worker` runs inside a release, `runner` drives the releases and
prints the table, `markdown` writes the report."""
