"""Requests with identities (`model.contract.extra_keys`): the model's statement of each block's
extra keys against vLLM's own key functions, the naming of prefixes per identity, the
trace format, and the model and vLLM's targets agreeing on salted, adapter and
multimodal requests (each with a control that shows the check can fail)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from model.contract.extra_keys import Identity, Keyed, MMItem, block_hash_keys, event_keys, keyed
from model.contract.observation import ScheduleResult, StepResult
from model.contract.ops import AddRequest, Finish, Schedule, op_from_json, op_to_json
from model.contract.prefix import prefix
from model.machine.allocator import AllocatorModel

BS = 4


def _random_identity(rng: random.Random, n: int) -> Identity:
    salt = rng.choice([None, "t1", "t2"])
    lora = rng.choice([None, ("ad", 1, "/ad"), ("ad", 2, "/ad"), ("ad", 1, "/other"), ("bd", 3, "/bd")])
    items: list[MMItem] = []
    pos = rng.randrange(0, 6)
    while pos < n - 1 and rng.random() < 0.7:
        ident = rng.choice(["img-a", "img-b"])
        length = {"img-a": 3, "img-b": 6}[ident]  # an identifier fixes its length
        if pos + length > n:
            break
        items.append(MMItem(ident, pos, length))
        pos += length + rng.randrange(0, 5)
    return Identity(salt, lora, tuple(items))


def _vllm_request(tokens: tuple[int, ...], identity: Identity, hbs: int = BS):  # type: ignore[no-untyped-def]
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from invariants.targets.vllm_identity import request_identity

    init_none_hash(sha256)
    kwargs = {"mm_features": None, **request_identity(identity)}
    return Request(
        request_id="r",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hbs, sha256),
        **kwargs,
    )


@pytest.mark.vllm
def test_the_models_block_keys_are_vllms():
    """`block_hash_keys` and `event_keys` equal vLLM's `generate_block_hash_extra_keys`
    and `to_event_extra_keys` on every block of random identities."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randrange(4, 40)
        identity = _random_identity(rng, n)
        req = _vllm_request(tuple(range(n)), identity)
        for start in range(0, n - BS + 1, BS):
            theirs, _ = generate_block_hash_extra_keys(req, start, start + BS, 0)
            assert block_hash_keys(identity, start, start + BS) == theirs, (identity, start)
            ev = to_event_extra_keys([theirs])
            assert (event_keys(identity, start, start + BS),) == tuple(ev or (None,))


@pytest.mark.vllm
def test_prefix_names_agree_with_vllms_hashes():
    """Two requests' prefixes are one name iff vLLM hashes them alike (same tokens,
    random identities): the naming separates exactly what vLLM's hash separates."""
    rng = random.Random(11)
    tokens = tuple(rng.randrange(3) for _ in range(32))
    pairs = 0
    for _ in range(150):
        a, b = _random_identity(rng, 32), _random_identity(rng, 32)
        ra, rb = _vllm_request(tokens, a), _vllm_request(tokens, b)
        for i in range(len(ra.block_hashes)):
            n = (i + 1) * BS
            same_hash = ra.block_hashes[i] == rb.block_hashes[i]
            same_name = prefix(keyed(tokens, a), n) is prefix(keyed(tokens, b), n)
            assert same_hash == same_name, (a, b, n)
            pairs += same_hash
    assert pairs > 10  # shared blocks happen (an item or a salt later in the prompt)


def test_the_key_statement_controls():
    """Controls: the salt is on the first block only, an adapter on every block, an
    item on every block it overlaps with its offset in that block."""
    ident = Identity("t", ("ad", 1, "/ad"), (MMItem("x", 2, 5),))
    assert block_hash_keys(ident, 0, 4) == (("lora", "ad", "/ad"), ("mm", "x", 2), ("cache_salt", "t"))
    assert block_hash_keys(ident, 4, 8) == (("lora", "ad", "/ad"), ("mm", "x", -2))
    assert block_hash_keys(ident, 8, 12) == (("lora", "ad", "/ad"),)
    assert event_keys(ident, 4, 8) == ("ad", ("x", -2))
    assert block_hash_keys(Identity(), 0, 4) is None


def test_names_separate_identities_and_share_before_an_item():
    toks = tuple(range(64))
    plain = prefix(toks, 16)
    assert prefix(keyed(toks, Identity(salt="t")), 16) is not plain
    assert prefix(keyed(toks, Identity(lora=("a", 1, "/a"))), 16) is not plain
    assert prefix(keyed(toks, Identity(lora=("a", 2, "/a"))), 16) is prefix(
        keyed(toks, Identity(lora=("a", 1, "/a"))), 16
    )
    image = keyed(toks, Identity(mm=(MMItem("x", 40, 4),)))
    assert prefix(image, 40) is prefix(toks, 40)  # the blocks before the item are shared
    assert prefix(image, 41) is not prefix(toks, 41)
    assert isinstance(image, Keyed) and type(keyed(toks, None)) is tuple


def test_an_add_with_an_identity_round_trips_through_json():
    op = AddRequest("r", (1, 2, 3, 4, 5), salt="t", lora=("a", 1, "/a"), mm=(("x", 1, 2),))
    data = op_to_json(op)
    assert data["mm"] == [["x", 1, 2]] and data["lora"] == ["a", 1, "/a"]
    assert op_from_json(data) == op
    assert "salt" not in op_to_json(AddRequest("r", (1,)))  # defaults left out: old traces unchanged
    for bad in (
        {"mm": [["x", 4, 5]]},
        {"salt": ""},
        {"lora": ["a", 0, "/a"]},
        {"mm": [["x", 0, 2], ["y", 1, 1]]},
    ):
        with pytest.raises(ValueError):
            op_from_json({"op": "add", "rid": "r", "prompt": [1, 2, 3, 4, 5], **bad})


def _hit(m: AllocatorModel, rid: str, prompt: tuple[int, ...], **identity: object) -> int:
    m.apply(AddRequest(rid, prompt, **identity))  # type: ignore[arg-type]
    obs = m.apply(Schedule(rid, 1000))
    m.apply(Finish(rid))
    assert isinstance(obs, ScheduleResult) and obs.hit is not None
    return obs.hit


def test_the_model_never_shares_a_block_across_identities():
    from invariants.layouts.presets import PRESETS

    m = AllocatorModel(replace(PRESETS["gemma-tiny"], num_blocks=64))
    p = tuple(range(1, 19))
    assert _hit(m, "a", p) == 0
    assert _hit(m, "b", p, salt="t1") == 0
    assert _hit(m, "c", p, salt="t1") == 16
    assert _hit(m, "d", p, lora=("ad", 1, "/ad")) == 0
    assert _hit(m, "e", p, lora=("ad", 2, "/ad")) == 16  # the int id is not hashed
    assert _hit(m, "f", p, mm=(("x", 9, 3),)) < 16  # the item splits the chain
    assert _hit(m, "g", p) == 16  # control: the same identity hits


def _drive_identities(factory):  # type: ignore[no-untyped-def]
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from drive import Drive

    from invariants.layouts.presets import PRESETS

    cfg = replace(PRESETS["gemma-tiny"], max_num_batched_tokens=64)
    d = Drive(cfg, factory)
    p = tuple(range(1, 19))
    hits = []
    for rid, kw in [
        ("a", {}),
        ("b", {"salt": "t1"}),
        ("c", {"salt": "t1"}),
        ("e", {"lora": ("ad", 1, "/ad")}),
        ("f", {"mm": (("img", 6, 5),)}),
        ("g", {"mm": (("img", 6, 5),), "salt": "t1"}),
        ("h", {"mm": (("img", 6, 5),), "salt": "t1"}),
    ]:
        d.do(AddRequest(rid, p, **kw))  # type: ignore[arg-type]
        if factory is None:
            d.steps((rid,), cfg.max_num_batched_tokens, 2)
            step = d.seen[-3]
            assert isinstance(step, StepResult)
            hits.append(step.results[0][1].hit)
        else:
            d.do(Schedule(rid, 64))
            obs = d.seen[-1]
            assert isinstance(obs, ScheduleResult)
            hits.append(obs.hit)
        d.do(Finish(rid))
    return hits, d.audited()


@pytest.mark.vllm
def test_vllms_real_scheduler_keeps_identities_apart_as_the_model_says():
    hits, found = _drive_identities(None)
    assert found == []
    assert hits == [0, 0, 16, 0, 0, 0, 16]
