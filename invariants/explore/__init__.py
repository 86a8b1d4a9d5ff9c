"""Exhaustive small-scope checking: every operation sequence to a depth, with a certificate.

Breadth-first search (`search`) over the operation alphabet a state offers
(`alphabet`), on a grid of small instances (`instances`), with states merged
by a canonical fingerprint (`fingerprint`) and frontier states kept as frozen
forks of the checker (`fork`). Every transition goes through the harness's
`Checker` (model differential and the whole catalogue); a violation comes back
as the shortest replayable trace, and each instance's coverage as a
`certificate.Certificate`.
"""
