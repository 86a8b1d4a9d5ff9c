"""The bug zoo: mutants that re-create real bug classes, to show what kvretain catches.

A checker that has never been seen to fail proves nothing. Each mutant is a
named, documented, small edit of one allocator *instance* (never a default,
never a patch that leaks into another target):

- `mutants_reference`: edits of `reference_impl`, applied through the
  allocator's component seam (a subclass for one instance) or by patching
  methods on that instance's own objects (its BlockPool, managers, ...).
- `mutants_vllm`: monkeypatches of the installed vLLM 0.33.0 inside a context
  manager that restores the originals on exit. They are process-global while
  the context is active (vLLM's classes are shared): run nothing else on vLLM
  meanwhile.

`runner.run_zoo` runs every applicable check against each mutant and reports
which check killed it and how fast; `cli` is `kvretain zoo`.
"""

from __future__ import annotations

from invariants.zoo.mutants_reference import REFERENCE_MUTANTS, ReferenceMutant, ZooReferenceTarget

__all__ = ["REFERENCE_MUTANTS", "ReferenceMutant", "ZooReferenceTarget"]
