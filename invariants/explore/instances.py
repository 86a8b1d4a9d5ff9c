"""The grid of small instances the exhaustive search covers.

An instance is a configuration plus the bounds of its operation alphabet: how
many requests may be live at once, which prompt lengths `add` draws, which
token budgets `schedule` and `step` offer. The grid spans every group layout
the model supports (full only, SWA only, full+SWA with equal and unequal block
sizes, full+Mamba in align mode, fine-grained Mamba, three groups), retention
None / 0 / k, Eagle off and on, lookahead slots, prefix caching off, pools of 3 to 8 blocks (the
null block included) and 1 to 3 live requests. Every configuration passes
`model.contract.config.validate` (checked when the grid is built, and by a test).

The grid depends on what the target can run (`grid_for`): a real scheduler
(`TargetFeatures.real_scheduler`) cannot run Eagle without lookahead slots
(vLLM's Eagle drafts at least one token), so there the Eagle instance is its
lookahead variant (`...-eagle-la1`, one slot: samples carry drafts), and it runs
`full-p8-eagle-la-hashes` too (Eagle's lookahead block hashes, vLLM's default; an
allocator without lookahead slots refuses it, so elsewhere it runs when named); a target
that can attach a KV connector (`TargetFeatures.connector`) gets one more,
small instance with a connector (`full-p6-connector`: offers, load and save
reports). Every target's grid names the same instances otherwise. Where the target's
engine decides every step (`TargetFeatures.engine_steps`: kvretain names what the engine
holds and writes nothing of its scheduler), each instance is built with a token budget
(`Config.max_num_batched_tokens`: the smallest of the instance's budgets above its
lookahead slots, the one that binds) and offers that budget alone (`engine_budget`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import cast

from invariants.targets.base import Target, TargetFeatures
from model.contract.config import Config, GroupSpec, validate
from model.contract.ops import Op

# Requests never grow past this: the search is about allocation, not long decodes.
MAX_MODEL_LEN = 24


@dataclass(frozen=True)
class Instance:
    """One bounded instance. `prompt_lengths` are in tokens; `budgets` serve both
    `schedule` (per request) and `step` (shared by the batch). A `vocabulary`
    replaces the generated alphabet: every state offers exactly those operations
    (the valid ones), request ids as written (`invariants.explore.handover`)."""

    name: str
    config: Config
    max_requests: int = 2
    prompt_lengths: tuple[int, ...] = ()
    budgets: tuple[int, ...] = ()
    note: str = field(default="", compare=False)
    vocabulary: tuple[Op, ...] = ()
    # Each prompt is also added under other identities (`alphabet.IDENTITIES`): isolation.
    tenants: bool = False

    def __post_init__(self) -> None:
        validate(self.config)
        sbs = self.config.scheduler_block_size
        if not self.prompt_lengths:
            object.__setattr__(self, "prompt_lengths", (sbs, 2 * sbs + 1))
        if not self.budgets:
            object.__setattr__(self, "budgets", (sbs, 64))
        if self.max_requests < 1:
            raise ValueError(f"instance {self.name}: max_requests must be >= 1")


def _cfg(groups: tuple[GroupSpec, ...], num_blocks: int, **kw: object) -> Config:
    return validate(Config(groups=groups, num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN, **kw))  # type: ignore[arg-type]


FULL2 = GroupSpec("full", 2)
FULL4 = GroupSpec("full", 4)
SWA2 = GroupSpec("swa", 2, sliding_window=3)
SWA2_W2 = GroupSpec("swa", 2, sliding_window=2)
MAMBA2 = GroupSpec("mamba", 2)
MAMBA4 = GroupSpec("mamba", 4)
MAMBA2_NONE = GroupSpec("mamba", 2, mamba_cache_mode="none")


EAGLE = "full+swa-p7-r0-eagle"
EAGLE_LOOKAHEAD = "full+swa-p7-r0-eagle-la1"
CONNECTOR = "full-p6-connector"


def default_grid(features: TargetFeatures | None = None) -> list[Instance]:
    """The grid `kvretain explore` runs for a target with `features` (the model's grid
    when None: no real scheduler, no connector instance), smallest first."""
    grid = _base_grid()
    if features is None:
        return grid
    if features.real_scheduler:
        grid = [_eagle_lookahead(i) if i.name == EAGLE else i for i in grid]
        grid.append(_lookahead_hashes())
    if features.connector:
        grid.append(
            Instance(
                CONNECTOR,
                _cfg((FULL2,), 6, kv_connector=True),
                max_requests=2,
                prompt_lengths=(4,),
                budgets=(64,),
                note="KV connector: offers (sync and async), load ok/failed, save reports",
            )
        )
    return [engine_budget(i) for i in grid] if features.engine_steps else grid


def engine_budget(inst: Instance) -> Instance:
    """`inst` for an engine that decides every step: built with a token budget, the smallest
    of its budgets above the lookahead slots (vLLM's budget must exceed them), its steps'
    only budget. An instance that states one already is left as it is."""
    cfg = inst.config
    if cfg.max_num_batched_tokens:
        return inst
    budget = min((b for b in inst.budgets if b > cfg.num_lookahead_tokens), default=64)
    return replace(inst, config=validate(cfg.with_(max_num_batched_tokens=budget)), budgets=(budget,))


def features_of(factory: Callable[[Config], Target]) -> TargetFeatures:
    """The features a target class states (a factory that is no class: the defaults)."""
    return cast("type[Target]", factory).features if isinstance(factory, type) else TargetFeatures()


def _eagle_lookahead(inst: Instance) -> Instance:
    """The Eagle instance as a real scheduler runs it: one lookahead slot (drafts)."""
    cfg = validate(replace(inst.config, num_lookahead_tokens=1))
    return Instance(
        EAGLE_LOOKAHEAD,
        cfg,
        max_requests=inst.max_requests,
        prompt_lengths=inst.prompt_lengths,
        budgets=inst.budgets,
        note="Eagle with one lookahead slot: vLLM's Eagle drafts at least one token",
    )


def _base_grid() -> list[Instance]:
    return [
        Instance("full-p3-r1", _cfg((FULL2,), 3), max_requests=1, budgets=(1, 64), note="3-block pool"),
        Instance("full-p5-r2", _cfg((FULL2,), 5, retention_interval=0), max_requests=2),
        Instance("swa-p5-r2", _cfg((SWA2,), 5, retention_interval=0), max_requests=2),
        Instance("full+swa-p7-dense", _cfg((FULL2, SWA2), 7), max_requests=2),
        Instance("full+swa-p7-r0-eagle", _cfg((FULL2, SWA2_W2), 7, retention_interval=0, eagle=True)),
        Instance(
            "full4+swa2-p8-k4",
            _cfg((FULL4, SWA2), 8, retention_interval=4),
            prompt_lengths=(4, 9),
            budgets=(2, 64),
            note="unequal block sizes",
        ),
        Instance(
            "full+swa-p8-lookahead", _cfg((FULL2, SWA2), 8, retention_interval=0, num_lookahead_tokens=1)
        ),
        Instance("full+mamba-p6-r0", _cfg((FULL2, MAMBA2), 6, retention_interval=0)),
        Instance(
            "full+mamba4-fine-p8",
            _cfg((FULL2, MAMBA4), 8, hash_block_size=2),
            prompt_lengths=(4, 9),
            budgets=(2, 64),
            note="fine-grained Mamba hits",
        ),
        Instance("three-groups-p8-k2", _cfg((FULL2, SWA2, MAMBA2), 8, retention_interval=2)),
        Instance("full-p8-r3", _cfg((FULL2,), 8), max_requests=3, prompt_lengths=(3,), budgets=(64,)),
        Instance(
            "three-groups-p8-nocache",
            _cfg((FULL2, SWA2, MAMBA2_NONE), 8, enable_caching=False),
            note="prefix caching off: the free order alone decides reuse; Mamba in 'none' mode",
        ),
    ]


def grid_by_name(names: list[str] | None = None, features: TargetFeatures | None = None) -> list[Instance]:
    """The target's grid (`default_grid`), or the named instances of it (KeyError naming an unknown one)."""
    grid = default_grid(features)
    if not names:
        return grid
    extra = [i for i in named_only() if i.name not in {g.name for g in grid}]
    if features is not None and features.engine_steps:
        extra = [engine_budget(i) for i in extra]
    by_name = {i.name: i for i in (*grid, *extra)}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise KeyError(f"unknown instance(s) {unknown} (known: {', '.join(by_name)})")
    return [by_name[n] for n in names]


TENANTS = "full-p6-tenants"
LOOKAHEAD_HASHES = "full-p8-eagle-la-hashes"


def named_only() -> list[Instance]:
    """Instances outside the default grid, run when named (`--instance`): isolation
    (each prompt under two tenants, an adapter pair and an image: `alphabet.IDENTITIES`;
    a target that takes no identity refuses those adds, `Target.identities`), and Eagle's
    lookahead block hashes (two prompts that share two blocks and differ in the token past
    them: a hash that omits it lets one hit the other's drafter KV; a target without
    lookahead slots refuses the configuration)."""
    return [
        Instance(
            TENANTS,
            _cfg((GroupSpec("full", 4),), 6),
            max_requests=2,
            prompt_lengths=(9,),
            budgets=(64,),
            tenants=True,
            note="isolation: the same tokens under other tenants, adapters and images",
        ),
        _lookahead_hashes(),
    ]


def _lookahead_hashes() -> Instance:
    """Eagle's lookahead block hashes (vLLM's default) on two 9-token prompts that share two
    4-token blocks and differ in the token past them: a hash that omits it lets one prompt
    hit KV the drafter computed past the block with the other's token."""
    return Instance(
        LOOKAHEAD_HASHES,
        _cfg((FULL4,), 8, eagle=True, num_lookahead_tokens=1, lookahead_block_hashes=True),
        max_requests=2,
        prompt_lengths=(9,),
        budgets=(64,),
        note="Eagle's lookahead block hashes: two prompts share two blocks, then differ in the token past them",
    )
