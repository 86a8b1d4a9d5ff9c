"""Allocator mutants that the equivalence check must catch (negative controls).

`reuse_without_evict` is the bug zoo's mutant of the same name
(`invariants.zoo.mutants_reference`): a block reused from the free queue
forgets its hash, but the hash map still points at it. The allocator's own
assertions stay quiet and only the data shows the bug: a later request hits a
block whose storage was overwritten by its new owner (or poisoned when it was
handed out), so some caching mode must report a mismatch against the
no-cache run. The zoo's fuzzer catches it by comparing observations; here it
must be caught by the outputs alone.
"""

from __future__ import annotations

from invariants.targets.base import Target
from invariants.zoo.mutants_reference import factory
from model.contract.config import Config

_reuse_without_evict = factory("reuse_without_evict")


def reuse_without_evict(config: Config) -> Target:
    """The reference allocator with the zoo's `reuse_without_evict` applied to this instance."""
    return _reuse_without_evict(config)
