"""Named configuration strategies for the zoo: each makes one bug class reachable.

`generated` is the fuzzer's own strategy (`invariants.strategies.configs`); the
others narrow it (only SWA shapes, only retention 0, only Eagle, only pinning,
only Mamba with a scheduler block wider than the Mamba block). A mutant names
the strategy it is run with and the zoo table prints it: a narrowed strategy
kills faster, never differently (every config it draws is one `generated`
could draw, except that `mamba-coarse` forces full block > Mamba block).
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from invariants.harness.strategies import configs, engine_runnable
from model.contract.config import Config, GroupSpec, validate

SWA_SHAPES: tuple[tuple[str, ...], ...] = (("swa",), ("full", "swa"), ("full", "swa"), ("full", "swa", "swa"))
RETENTION_SHAPES: tuple[tuple[str, ...], ...] = (*SWA_SHAPES, ("full", "mamba"), ("full", "swa", "mamba"))
MAMBA_SHAPES: tuple[tuple[str, ...], ...] = (("full", "mamba"), ("full", "swa", "mamba"))
# Speculative decoding through a real scheduler: the spec-decoding mutants are caught without Mamba
# (the Mamba draft blocks are judged by the conformance row and tests/test_vllm_scheduler_spec.py).
SPEC_SHAPES: tuple[tuple[str, ...], ...] = (("full",), *SWA_SHAPES)
# 3 spec groups (the coordinator's fixed point iterates).
MULTI_SHAPES: tuple[tuple[str, ...], ...] = (("full", "swa", "swa"),)


@st.composite
def zoo_configs(
    draw: st.DrawFn,
    *,
    shapes: tuple[tuple[str, ...], ...],
    retention: str = "any",
    eagle: bool | None = None,
    pin: bool = False,
    coarse_mamba: bool = False,
) -> Config:
    """Like `configs()` (same sizes and pools), restricted as asked; caching always on."""
    shape = draw(st.sampled_from(shapes))
    base = draw(st.sampled_from([2, 4]))
    groups = []
    for kind in shape:
        if kind == "mamba" or len(shape) == 1:
            bs = base * (1 if kind == "mamba" else draw(st.sampled_from([1, 2])))
        elif kind == "full" and coarse_mamba:
            bs = base * draw(st.sampled_from([2, 4]))
        else:
            bs = base * draw(st.sampled_from([1, 2, 4]))
        window = draw(st.integers(2, 3 * bs)) if kind == "swa" else None
        groups.append(GroupSpec(kind, bs, sliding_window=window))  # type: ignore[arg-type]
    sbs = math.lcm(*(g.block_size for g in groups))
    by_name: dict[str, list[int | None]] = {
        "any": [None, 0, 0, sbs, 2 * sbs, 3 * sbs],
        "sparse": [0, 0, sbs, 2 * sbs],
        "zero": [0],
    }
    choices = by_name[retention]
    cfg = Config(
        groups=tuple(groups),
        num_blocks=draw(st.integers(6, 28)),
        retention_interval=draw(st.sampled_from(choices)),
        eagle=draw(st.booleans()) if eagle is None else eagle,
        enable_caching=True,
        pin_swa_on_drop=pin,
        pin_min_drop_blocks=draw(st.integers(0, 2)) if pin else 1,
        max_model_len=4096,
    )
    return validate(cfg)


def strategy(
    name: str, *, allow_pinning: bool, allow_fine: bool = True, real_scheduler: bool = False
) -> st.SearchStrategy[Config]:
    """The named strategy (KeyError naming the known ones). `allow_fine`: whether
    generated configurations may turn on fine-grained Mamba hits (the reference
    allocator refuses them). `real_scheduler`: only configurations a real scheduler
    can be built with (`strategies.engine_runnable`)."""
    base = _strategy(name, allow_pinning=allow_pinning, allow_fine=allow_fine)
    if not real_scheduler:
        return base
    return st.builds(engine_runnable, base, st.integers(1, 3))


def _strategy(name: str, *, allow_pinning: bool, allow_fine: bool) -> st.SearchStrategy[Config]:
    table = {
        "generated": lambda: configs(allow_pinning=allow_pinning, allow_fine=allow_fine),
        "swa": lambda: zoo_configs(shapes=SWA_SHAPES),
        "swa-sparse": lambda: zoo_configs(shapes=SWA_SHAPES, retention="sparse"),
        "retention0": lambda: zoo_configs(shapes=RETENTION_SHAPES, retention="zero"),
        "eagle-swa": lambda: zoo_configs(shapes=SWA_SHAPES, retention="sparse", eagle=True),
        "eagle-multi": lambda: zoo_configs(shapes=MULTI_SHAPES, eagle=True),
        "pinning": lambda: zoo_configs(shapes=SWA_SHAPES, pin=True),
        "mamba-sparse": lambda: zoo_configs(shapes=MAMBA_SHAPES, retention="sparse"),
        "mamba-coarse": lambda: zoo_configs(shapes=(("full", "mamba"),), retention="zero", coarse_mamba=True),
        # A real scheduler (vllm), speculative decoding left to "scheduler-spec".
        "scheduler": lambda: configs(
            allow_pinning=False, allow_fine=allow_fine, eagle=False, lookahead=False
        ),
        # A real scheduler speculating: Full/SWA shapes, drafts (Eagle/MTP or a draft model).
        "scheduler-spec": lambda: configs(
            allow_pinning=False, shapes=SPEC_SHAPES, lookahead=True, eagle_drafts=True, caching=True
        ),
        "scheduler-mamba": lambda: configs(
            allow_pinning=False, shapes=MAMBA_SHAPES, allow_fine=allow_fine, eagle=False, lookahead=False
        ),
        # A real scheduler with kvretain's KV connector (`model.machine.connector`: Full/SWA shapes).
        "scheduler-connector": lambda: configs(
            allow_pinning=False,
            shapes=SWA_SHAPES + (("full",),),
            eagle=False,
            lookahead=False,
            connector=True,
        ),
        # The same on one KV cache group (Full or SWA): only there does generation name the blocks
        # a load failed on and leave async loads in flight beside running requests (the machine's
        # `shared_load`), so several requests hold loads, or a failed block, at once: the order
        # the connector's queues are left in and scanned in (`mutants_queues`).
        "scheduler-connector-one-group": lambda: configs(
            allow_pinning=False, shapes=(("full",), ("swa",)), eagle=False, lookahead=False, connector=True
        ),
        # The same with a Mamba group (`model.machine.connector`: its external state block; no fine-grained hits).
        "scheduler-connector-mamba": lambda: configs(
            allow_pinning=False, shapes=MAMBA_SHAPES, eagle=False, lookahead=False, connector=True
        ),
        # The same with fine-grained Mamba hits: external tokens past a hit's sub-block tail.
        "scheduler-connector-fine": lambda: configs(
            allow_pinning=False,
            shapes=(("full", "mamba"),),
            caching=True,
            eagle=False,
            lookahead=False,
            fine=True,
            connector=True,
        ),
        # The connector with drafts (Eagle/MTP or a draft model), every shape, either policy.
        "scheduler-connector-spec": lambda: configs(
            allow_pinning=False, allow_fine=allow_fine, lookahead=True, eagle_drafts=True, connector=True
        ),
        # A real scheduler with a long-prefill threshold (drafts and Mamba included).
        "scheduler-long-prefill": lambda: configs(
            allow_pinning=False, allow_fine=allow_fine, eagle_drafts=True, long_prefill=True
        ),
        # Full attention + a Mamba block 2 or 4 hash blocks wide: fine-grained hits and copies.
        "mamba-fine": lambda: configs(
            allow_pinning=False, shapes=(("full", "mamba"),), caching=True, eagle=False, fine=True
        ),
    }
    if name not in table:
        raise KeyError(f"unknown config strategy {name!r} (known: {', '.join(table)})")
    return table[name]()


STRATEGY_NAMES = (
    "generated",
    "swa",
    "swa-sparse",
    "retention0",
    "eagle-swa",
    "eagle-multi",
    "pinning",
    "mamba-sparse",
    "mamba-coarse",
    "mamba-fine",
    "scheduler",
    "scheduler-mamba",
    "scheduler-spec",
    "scheduler-connector",
    "scheduler-connector-one-group",
    "scheduler-long-prefill",
    "scheduler-connector-mamba",
    "scheduler-connector-fine",
    "scheduler-connector-spec",
)
