"""Production link, the hybrid hit: vLLM 0.33.0's fixed point equals the model's on a bounded domain.

`HybridKVCacheCoordinator.find_longest_cache_hit` (vLLM
`kv_cache_coordinator.py`) against `model.contract.hybrid_hit.reconcile` with the
model's finders (`model.contract.lookup`, `model.contract.fine_mamba`) and the 0.33.0 rules
(`model.contract.profile.rules_of(MODELED)`), composed as `AllocatorModel` composes
them (`ModelHit`; `tests/test_coordinator_link.py` ties it to the
allocator's own lookup). Compared per input: the hit length, every group's
layout (which key each table position reads, or the null block) and the
junction.

The junction: vLLM's coordinator returns `longest - hit`
(`num_uncached_common_prefix_tokens`, where `longest` is the longest hit any
group reached alone) and `KVCacheManager.get_computed_blocks` turns it into
`shared_prefix_boundary = hit + (longest - hit)` when it is not 0, else 0. The
model's `reconcile` returns that boundary directly (`longest` when above the
hit, else 0). The check compares the model's junction with vLLM's figure
converted the way `get_computed_blocks` converts it.

What is real and what is faked. Real: vLLM's `KVCacheManager`, built from the
instance's group specs (`group_specs`, the specs `invariants.targets.vllm_build`
builds; a test holds them equal) with its scheduler and hash block sizes and
Eagle flag; its coordinator, single-type managers, spec grouping, alignment,
fine-grained switch, hash-list views. Faked: the block pool the managers read
during the lookup (`_KeyPool`), which holds exactly what
`find_longest_cache_hit` reads of a `BlockPool`: `hash_block_size`,
`null_block`, and `get_cached_block(hash, group ids)`, answering per group
from a set of cached keys; and the request's block hashes, which are the
integers 0..H-1 (hash i names the prefix of (i+1) * hash_block_size tokens, so
distinct prefixes have distinct hashes, as chained hashes do). Every
manager's `block_pool` attribute is pointed at the fake after construction.

The domain (`Domain.describe` states it in the result): a layout (group kinds
in table order, full attention first or not), each group's block size, SWA
windows, the hash and scheduler block sizes, Eagle on or off; a request whose
first T tokens are hashed (`hashed_tokens`: a multiple of the lcm of the block
sizes); for each group independently, every subset of its keys up to T (at
every hash block for a group whose lookup probes inside its blocks, else at
its block ends: the only keys a lookup reads); every `max_cache_hit_length`
in [0, T + hbs - 2].

Which of these inputs the manager's API reaches. `get_computed_blocks`
passes `num_tokens - 1`, in [T - 1, T + hbs - 2] for a request with T hashed
tokens; a lower limit comes only from an explicit `max_cache_hit_length`
(the scheduler's aux output connector). The cached sets are a superset of
what caching and eviction leave (full attention's keys, freed tail first,
are mostly downward closed; SWA and Mamba keep what their masks keep). A
disagreement's report says which limit it needs; the check itself needs no
reachability argument, since over the stated domain it claims agreement on
every input.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from model.contract import hybrid_hit, lookup
from model.contract.config import Config, GroupKind, GroupSpec, validate
from model.contract.fine_mamba import (
    KeyLayout,
    coarse_keys,
    fine_full_hit,
    fine_hits_enabled,
    fine_mamba_hit,
    is_fine_lookup,
)
from model.contract.masks import swa_tail_blocks
from model.contract.profile import MODELED, rules_of


@dataclass(frozen=True)
class Domain:
    """The bounded domain of the check (stated in its result)."""

    layouts: tuple[tuple[GroupKind, ...], ...]  # group kinds in table order
    sizes_two: tuple[int, ...]  # a 2-group layout: every assignment of these block sizes
    sizes_three: tuple[int, ...]  # a 3-group layout: every assignment of these
    window_blocks: tuple[int, ...]  # SWA window = 1 + k * block size (k blocks below a boundary)
    scheduler_multiples: tuple[int, ...]  # scheduler block = lcm of the block sizes times this
    finer_hash: bool  # also hash block 1 where the gcd of the block sizes is above 1
    max_span: int  # hashed tokens T at most this many scheduler blocks ...
    max_keys: int  # ... and holding at most this many keys in all (`hashed_tokens`)

    def describe(self) -> str:
        kinds = ", ".join("+".join(k) for k in self.layouts)
        return (
            f"layouts {{{kinds}}}; block sizes: every assignment from {list(self.sizes_two)} (2 groups), "
            f"{list(self.sizes_three)} (3 groups); SWA window 1 + k*bs, k in {list(self.window_blocks)}; "
            f"scheduler block = lcm * {list(self.scheduler_multiples)}; hash block = gcd"
            f"{' and 1' if self.finer_hash else ''}; Eagle both; hashed tokens T: the largest multiple "
            f"of the lcm up to {self.max_span} scheduler blocks with at most {self.max_keys} keys "
            f"(at least the lcm); every subset of each group's keys up to T; every max length in "
            f"[0, T + hbs - 2]"
        )


FULL = Domain(
    layouts=(
        ("full", "swa"),
        ("swa", "full"),
        ("full", "mamba"),
        ("swa", "mamba"),
        ("swa", "swa"),
        ("full", "full"),
        ("full", "swa", "mamba"),
        ("mamba", "swa", "full"),
        ("full", "swa", "swa"),
        ("swa", "mamba", "mamba"),
    ),
    sizes_two=(1, 2, 4),
    sizes_three=(1, 2),
    window_blocks=(0, 1, 2),
    scheduler_multiples=(1, 2),
    finer_hash=True,
    max_span=3,
    max_keys=7,
)
QUICK = Domain(
    layouts=(("full", "swa"), ("full", "mamba"), ("swa", "mamba"), ("full", "swa", "mamba")),
    sizes_two=(1, 2),
    sizes_three=(1, 2),
    window_blocks=(1, 2),
    scheduler_multiples=(1, 2),
    finer_hash=False,
    max_span=2,
    max_keys=6,
)


@dataclass(frozen=True)
class Instance:
    """One configuration of the domain, and its hashed tokens."""

    cfg: Config
    hashed: int  # T: the request's hashed tokens

    def key_positions(self, gid: int) -> list[int]:
        """Where group `gid` can hold a key up to T: every hash block if its lookup
        probes inside its blocks, else its block ends (the only keys it reads)."""
        g = self.cfg.groups[gid]
        step = self.cfg.hash_block_size if is_fine_lookup(self.cfg, g.kind, g.block_size) else g.block_size
        return list(range(step, self.hashed + 1, step))

    def num_keys(self) -> int:
        return sum(len(self.key_positions(g)) for g in range(len(self.cfg.groups)))

    def describe(self) -> str:
        groups = ", ".join(
            f"{g.kind}(bs={g.block_size}{'' if g.sliding_window is None else f', window={g.sliding_window}'})"
            for g in self.cfg.groups
        )
        return (
            f"groups [{groups}], hash block {self.cfg.hash_block_size}, scheduler block "
            f"{self.cfg.scheduler_block_size}, eagle={self.cfg.eagle}, hashed tokens {self.hashed}"
        )


def instances(dom: Domain) -> Iterator[Instance]:
    """Every configuration of the domain, in a fixed order."""
    for kinds in dom.layouts:
        choices = dom.sizes_two if len(kinds) == 2 else dom.sizes_three
        for sizes in itertools.product(choices, repeat=len(kinds)):
            swa_ids = [i for i, k in enumerate(kinds) if k == "swa"]
            for ks in itertools.product(dom.window_blocks, repeat=len(swa_ids)):
                windows = dict(zip(swa_ids, ks))
                groups = tuple(
                    GroupSpec(k, bs, 1 + windows[i] * bs if k == "swa" else None)
                    for i, (k, bs) in enumerate(zip(kinds, sizes))
                )
                gcd, lcm = math.gcd(*sizes), math.lcm(*sizes)
                hash_sizes = sorted({gcd, 1} if dom.finer_hash else {gcd})
                for hbs, mult, eagle in itertools.product(hash_sizes, dom.scheduler_multiples, (False, True)):
                    cfg = Config(
                        groups,
                        num_blocks=16,
                        eagle=eagle,
                        hash_block_size=hbs,
                        scheduler_block_size=lcm * mult,
                    )
                    yield Instance(validate(cfg), hashed_tokens(cfg, dom, lcm))


def hashed_tokens(cfg: Config, dom: Domain, lcm: int) -> int:
    """T: the largest multiple of `lcm` up to `max_span` scheduler blocks whose keys
    number at most `max_keys` (`lcm` if none does)."""
    for t in range(dom.max_span * cfg.scheduler_block_size, lcm, -lcm):
        if Instance(cfg, t).num_keys() <= dom.max_keys:
            return t
    return lcm


# ------------------------------------------------------------------ the model's side
class ModelHit:
    """The model's hybrid hit for one configuration: `reconcile` with the finders and
    rules `AllocatorModel` uses under the 0.33.0 profile (`AllocatorModel._finder`,
    `_reconcile_hybrid_hit`), over cached keys given per group as the token lengths
    of the prefixes whose key the group holds."""

    def __init__(self, cfg: Config, hashed: int) -> None:
        rules = rules_of(MODELED)
        self.cfg = cfg
        self.hashed = hashed
        self.rules = hybrid_hit.HitRules(
            cfg,
            looks_past=rules.looks_past,
            margin_reach=rules.margin_reach,
            full_bound=rules.full_bound,
            junction=rules.junction,
        )
        self.alignment = cfg.hash_block_size if fine_hits_enabled(cfg) else cfg.scheduler_block_size
        self.fine = {(g.kind, g.block_size): is_fine_lookup(cfg, g.kind, g.block_size) for g in cfg.groups}
        self.spec_groups = len(hybrid_hit.spec_groups(cfg.groups))
        self.calls = 0  # the finders' calls in the last lookup

    def __call__(self, keyed: Sequence[set[int]], max_len: int) -> tuple[dict[int, KeyLayout], int, int]:
        """(per-group layouts, hit, junction or 0)."""
        cfg, hbs, hashed, alignment = self.cfg, self.cfg.hash_block_size, self.hashed, self.alignment
        self.calls = 0

        def find(spec: GroupSpec, gids: list[int], limit: int, drop: bool) -> tuple[KeyLayout, int]:
            self.calls += 1
            at: Callable[[int], bool] = (
                keyed[gids[0]].__contains__ if len(gids) == 1 else lambda n: all(n in keyed[g] for g in gids)
            )

            bs = spec.block_size
            if self.fine[spec.kind, bs]:
                if spec.kind == "full":
                    return fine_full_hit(at, limit, bs, hbs, hashed, drop)
                return fine_mamba_hit(at, limit, bs, hbs, hashed)

            def cached(j: int) -> bool:
                return at((j + 1) * bs)

            if spec.kind == "full":
                return coarse_keys(lookup.full_hit(cached, limit, bs, alignment, drop), bs)
            if spec.kind == "swa":
                assert spec.sliding_window is not None
                need = swa_tail_blocks(spec.sliding_window, bs, drop)
                return coarse_keys(lookup.swa_hit(cached, limit, bs, alignment, need, drop), bs)
            return coarse_keys(lookup.mamba_hit(cached, limit, bs, alignment), bs)

        return hybrid_hit.reconcile(list(cfg.groups), find, max_len, hashed, self.rules)


# ------------------------------------------------------------------ vLLM's side
def group_specs(cfg: Config, v: dict[str, Any]) -> list[Any]:
    """vLLM `KVCacheGroupSpec`s for `cfg`, as `invariants.targets.vllm_build.group_specs`
    builds them (one layer per group, one float32 element per token)."""
    torch = v["torch"]
    out = []
    for i, g in enumerate(cfg.groups):
        if g.kind == "full":
            spec = v["FullAttentionSpec"](
                block_size=g.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
            )
        elif g.kind == "swa":
            spec = v["SlidingWindowSpec"](
                block_size=g.block_size,
                num_kv_heads=1,
                head_size=1,
                dtype=torch.float32,
                sliding_window=g.sliding_window,
            )
        else:
            spec = v["MambaSpec"](
                block_size=g.block_size,
                shapes=((1,),),
                dtypes=(torch.float32,),
                mamba_cache_mode=g.mamba_cache_mode,
            )
        out.append(v["KVCacheGroupSpec"]([f"layer{i}"], spec))
    return out


class _Key:
    """A block the fake pool hands out: group `group`'s key of the first `tokens` tokens."""

    __slots__ = ("group", "tokens")

    def __init__(self, group: int, tokens: int) -> None:
        self.group = group
        self.tokens = tokens


class _KeyPool:
    """What `find_longest_cache_hit` reads of a `BlockPool`. Hash i names the prefix
    of (i + 1) * hash_block_size tokens; group g holds it iff that length is in
    `keyed[g]`; `get_cached_block` answers None unless every asked group holds it."""

    def __init__(self, hash_block_size: int, num_groups: int, hashed: int) -> None:
        self.hash_block_size = hash_block_size
        self.null_block = _Key(-1, 0)
        self.keyed: list[set[int]] = [set() for _ in range(num_groups)]
        self._blocks = [[_Key(g, n) for n in range(hashed + 1)] for g in range(num_groups)]

    def get_cached_block(self, block_hash: int, kv_cache_group_ids: Sequence[int]) -> list[_Key] | None:
        n = (block_hash + 1) * self.hash_block_size
        if all(n in self.keyed[g] for g in kv_cache_group_ids):
            return [self._blocks[g][n] for g in kv_cache_group_ids]
        return None


def build_coordinator(inst: Instance, v: dict[str, Any]) -> tuple[Any, _KeyPool]:
    """vLLM's hybrid coordinator for the instance, its managers reading the fake pool."""
    cfg = inst.cfg
    kv_cfg = v["KVCacheConfig"](
        num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=group_specs(cfg, v)
    )
    manager = v["KVCacheManager"](
        kv_cfg,
        max_model_len=cfg.max_model_len,
        scheduler_block_size=cfg.scheduler_block_size,
        hash_block_size=cfg.hash_block_size,
        enable_caching=True,
        use_eagle=cfg.eagle,
    )
    coord = manager.coordinator
    assert isinstance(coord, v["HybridKVCacheCoordinator"]), type(coord).__name__
    pool = _KeyPool(cfg.hash_block_size, len(cfg.groups), inst.hashed)
    for m in coord.single_type_managers:
        m.block_pool = pool
    return coord, pool


def vllm_hit(
    coord: Any, pool: _KeyPool, hashes: list[int], max_len: int
) -> tuple[dict[int, KeyLayout], int, int]:
    """vLLM's (per-group layouts as keys, hit, uncached common prefix = longest - hit).
    A block of another group than the row's reads as key -1 (never the model's)."""
    blocks, hit, uncached = coord.find_longest_cache_hit(hashes, max_len)
    null = pool.null_block
    layouts = {
        gid: [None if b is null else b.tokens if b.group == gid else -1 for b in row]
        for gid, row in enumerate(blocks)
    }
    return layouts, hit, uncached


# ------------------------------------------------------------------ the check
def _subsets(items: list[int]) -> Iterator[set[int]]:
    for mask in range(1 << len(items)):
        yield {x for i, x in enumerate(items) if mask >> i & 1}


@dataclass
class Tally:
    """What the agreeing cases covered: cases, configurations, and the cases with a
    positive hit, with a junction, and where the fixed point took a second round (the
    model's finders asked more often than once per spec group)."""

    cases: int = 0
    configs: int = 0
    with_hit: int = 0
    with_junction: int = 0
    with_rounds: int = 0

    def describe(self) -> str:
        return (
            f"{self.cases} cases over {self.configs} configurations, {self.with_hit} with a hit, "
            f"{self.with_junction} with a junction, {self.with_rounds} with a second round"
        )


def check_instance(inst: Instance, v: dict[str, Any], tally: Tally | None = None) -> str | None:
    """Every cached key subset and max length of one instance: the first disagreement, or None."""
    tally = tally if tally is not None else Tally()
    cfg = inst.cfg
    coord, pool = build_coordinator(inst, v)
    hbs = cfg.hash_block_size
    hashes = list(range(inst.hashed // hbs))
    lengths = range(0, inst.hashed + hbs - 1)
    per_group = [list(_subsets(inst.key_positions(g))) for g in range(len(cfg.groups))]
    model_hit = ModelHit(cfg, inst.hashed)
    tally.configs += 1
    for keyed in itertools.product(*per_group):
        pool.keyed[:] = keyed
        for max_len in lengths:
            want = model_hit(keyed, max_len)
            got_layouts, got_hit, uncached = vllm_hit(coord, pool, hashes, max_len)
            tally.cases += 1
            got_junction = got_hit + uncached if uncached else 0
            if (got_layouts, got_hit, got_junction) != want:
                return _explain(inst, keyed, max_len, (got_layouts, got_hit, uncached), want)
            tally.with_hit += got_hit > 0
            tally.with_junction += got_junction > 0
            tally.with_rounds += model_hit.calls > model_hit.spec_groups
    return None


def _explain(
    inst: Instance,
    keyed: Sequence[set[int]],
    max_len: int,
    got: tuple[dict[int, KeyLayout], int, int],
    want: tuple[dict[int, KeyLayout], int, int],
) -> str:
    layouts, hit, uncached = got
    reach = "the default" if max_len >= inst.hashed - 1 else "only an explicit"
    keys = "; ".join(f"group {g}: {sorted(k)}" for g, k in enumerate(keyed))
    return (
        f"{inst.describe()}, max length {max_len} ({reach} get_computed_blocks limit), cached keys "
        f"(prefix lengths) {keys}: vLLM hit {hit}, uncached common prefix {uncached} "
        f"(junction {hit + uncached if uncached else 0}), layouts {layouts}; the model hit {want[1]}, "
        f"junction {want[2]}, layouts {want[0]}"
    )


def check_coordinator(v: dict[str, Any], dom: Domain) -> tuple[Tally, str | None]:
    """The check over the whole domain: what it covered, and the first disagreement or None."""
    tally = Tally()
    for inst in instances(dom):
        bad = check_instance(inst, v, tally)
        if bad is not None:
            return tally, bad
    return tally, None
