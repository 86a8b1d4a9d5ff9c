"""Campaigns on Ray (`invariants.campaign`, `kvretain explore --ray`, `kvretain fuzz --ray`).

- explore on a local Ray instance with 2 workers writes the certificate a
  one-process run writes (per-depth distinct counts, transitions, known
  findings, why it stopped, fork checks), also where the one-process search
  stops inside a layer (the state bound, a planted defect's shortest trace);
  control: shards that forget the states of earlier depths change it; so do
  live restore where it cannot record (thawed instead, said so), a target plain
  pickle refuses (frozen portably for its owner), and `restore="pickle"`;
- a state's owner is the same in every process (`route`); control: `hash()`
  is not, so routing by it would expand a state on two workers;
- a fuzz campaign over 8 seeds merges into one report whose counts are the
  sums of the 8 runs made one by one here, known findings merged per finding,
  each run's trace files kept; control: the runs differ from seed to seed;
- the commands: the same figures through `kvretain`, bad input exits 2.

The module starts one local Ray instance (2 CPUs; 10-30 s on a loaded 2-core
machine) and shuts it down at the end. The searches with the plain shards share
one driver (its two worker processes kept from search to search, as a grid run
keeps them); a test that needs the instance's CPUs for its own workers or tasks
takes `free_cpus`, which closes it first. The fuzz comparison runs 8 fuzz runs
here and 8 on Ray (the done-when of issue 42): about 40 s.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the optional Ray extra (requirements/ray.txt) is not installed")

import test_campaign_shards  # noqa: E402
from test_campaign_shards import HoldsModuleAndClosure, Ticking  # noqa: E402

from invariants.campaign import Session, connect, parse_address  # noqa: E402
from invariants.campaign.explore import CampaignError, Driver, Shard, explore_on_ray  # noqa: E402
from invariants.campaign.route import route  # noqa: E402
from invariants.cli.main import main  # noqa: E402
from invariants.errors import UsageError  # noqa: E402
from invariants.explore.instances import Instance, grid_by_name  # noqa: E402
from invariants.explore.search import Limits, explore  # noqa: E402
from invariants.targets.model_target import ModelTarget  # noqa: E402
from model.contract.config import Config  # noqa: E402
from model.contract.observation import Done, Observation  # noqa: E402
from model.contract.ops import Finish, Op, Preempt  # noqa: E402

# Classes defined here travel to the Ray workers by value (the workers cannot import tests/).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(test_campaign_shards)

FULL, SWA, TINY = grid_by_name(["full-p5-r2", "swa-p5-r2", "full-p3-r1"])


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    s = connect("local:2")
    try:
        yield s
    finally:
        import ray as ray_module

        ray_module.shutdown()


class SharedDriver:
    """One `Driver` of the plain shards for the searches that use them, started at the first
    and closed before a test that needs the instance's CPUs (each of its 2 workers holds one)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.driver: Driver | None = None

    def get(self) -> Driver:
        if self.driver is None:
            self.driver = Driver(self.session)
        return self.driver

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
            self.driver = None


@pytest.fixture(scope="module")
def shards(session: Session) -> Iterator[SharedDriver]:
    shared = SharedDriver(session)
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def free_cpus(shards: SharedDriver) -> None:
    """The instance's CPUs, free for a test's own workers or Ray tasks."""
    shards.close()


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The certificate fields that differ (time aside)."""
    return [k for k in a if k != "seconds" and a[k] != b[k]]


class LeaksAfterResume(ModelTarget):
    """Planted defect (as in test_explore): finishing a request that was preempted and
    re-admitted drops it without freeing its blocks; shortest path five operations."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.preempted: set[str] = set()

    def apply(self, op: Op) -> Observation:
        if isinstance(op, Preempt):
            self.preempted.add(op.rid)
        req = self._model.requests.get(getattr(op, "rid", ""))
        if isinstance(op, Finish) and op.rid in self.preempted and req is not None and req.running:
            del self._model.requests[op.rid]
            return Done()
        return super().apply(op)


class RoutesByHash(Shard):
    """Planted defect: owners named by `hash()`, which differs between processes."""

    def owner(self, state: Any) -> int:
        return hash(state) % self.n


@pytest.mark.parametrize(("instance", "depth"), [(FULL, 4), (SWA, 3)])
def test_explore_on_ray_writes_the_one_process_certificate(
    session: Session, shards: SharedDriver, instance: Instance, depth: int
) -> None:
    one = explore(instance, ModelTarget, "model", Limits(depth))
    two = explore_on_ray(session, instance, "model", Limits(depth), factory=ModelTarget, driver=shards.get())
    assert session.workers == 2
    assert two.new_states == one.new_states and len(one.new_states) == depth + 1
    assert not _same(one.to_json(), two.to_json()), _same(one.to_json(), two.to_json())
    assert two.fork_checks == 2 and two.error is None


@pytest.mark.parametrize(
    ("factory", "restore"),
    [(Ticking, "live"), (HoldsModuleAndClosure, "live"), (ModelTarget, "pickle")],
    ids=["live-restore-unavailable", "portable-freeze", "restore-pickle"],
)
def test_restores_and_portable_freezes_write_the_one_process_certificate(
    session: Session, shards: SharedDriver, factory: Any, restore: str
) -> None:
    """A checker live restore cannot record (thawed instead, and said so), one plain pickle
    cannot freeze (sent to its owner as `campaign.portable` freezes it), and thawing per
    operation: the certificate is the one-process search's, `restore` included."""
    one = explore(FULL, factory, "model", Limits(3), restore=restore)
    two = explore_on_ray(
        session, FULL, "model", Limits(3), factory=factory, driver=shards.get(), restore=restore
    )
    assert not _same(one.to_json(), two.to_json()), _same(one.to_json(), two.to_json())
    assert two.restore == ("live" if factory is HoldsModuleAndClosure else one.restore) and two.states > 100


@pytest.mark.vllm
@pytest.mark.slow  # 85 s on the loaded 2-core machine: vLLM imported here and in both workers
def test_explore_on_ray_against_vllms_real_scheduler(session: Session, free_cpus: None) -> None:
    """vLLM's frozen checkers cannot be pickled plainly: they travel by cloudpickle, and the
    scheduler's hidden state is in every fingerprint; the certificate is still the same."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from invariants.targets import target_factory

    one = explore(TINY, target_factory("vllm"), "vllm", Limits(3))
    two = explore_on_ray(session, TINY, "vllm", Limits(3))
    assert len(two.new_states) == 4 and two.fork_checks == 2
    assert not _same(one.to_json(), two.to_json()), _same(one.to_json(), two.to_json())


def test_a_stop_inside_a_layer_is_where_one_process_stops(
    session: Session, shards: SharedDriver, tmp_path: Path
) -> None:
    bound = Limits(4, max_states=100)
    one, two = (
        explore(FULL, ModelTarget, "model", bound),
        explore_on_ray(session, FULL, "model", bound, factory=ModelTarget, driver=shards.get()),
    )
    assert "max states (100)" in two.stopped and two.states == 100
    assert not _same(one.to_json(), two.to_json()), _same(one.to_json(), two.to_json())
    one = explore(TINY, LeaksAfterResume, "model", Limits(6), out_dir=tmp_path / "one")
    two = explore_on_ray(
        session,
        TINY,
        "model",
        Limits(6),
        factory=LeaksAfterResume,
        out_dir=tmp_path / "two",
        driver=shards.get(),
    )
    assert two.trace_length == 5 and two.reproduced and two.path == one.path
    a, b = one.to_json(), two.to_json()
    assert [k for k in _same(a, b) if k != "trace"] == []
    assert json.loads(Path(b["trace"]).read_text())["ops"] == json.loads(Path(a["trace"]).read_text())["ops"]


def test_control_owners_by_hash_expand_states_twice(session: Session, free_cpus: None) -> None:
    """Depth 3 (175 states) shows it as depth 4 did (1,051), at a sixth of the search."""
    one = explore(FULL, ModelTarget, "model", Limits(3))
    driver = Driver(session, RoutesByHash)
    try:
        two = explore_on_ray(session, FULL, "model", Limits(3), factory=ModelTarget, driver=driver)
    except CampaignError:  # no worker thought it owned the initial state
        return
    finally:
        driver.close()
    assert two.new_states != one.new_states


def _states(depth: int) -> list[Any]:
    shard = Shard(0, 1)
    shard.reset(FULL, "model", ModelTarget)
    shard.root()
    for d in range(1, depth + 1):
        out = shard.expand(d == depth, None)
        won = shard.dedup(out[1])
        if d < depth:
            shard.ship(won[1])
            shard.adopt([])
    return list(shard.seen)


def test_a_states_owner_is_the_same_in_every_process(session: Session, free_cpus: None) -> None:
    states = _states(2)
    here = [route(s) for s in states]
    there = ray.get(ray.remote(lambda xs: [route(s) for s in xs]).remote(states))
    assert here == there and len(set(here)) > len(states) // 2
    # Control: hash() of the same states differs between processes (it hashes None by
    # address in Python 3.11, strings under a per-process seed): owners by hash() would not agree.
    theirs = ray.get(ray.remote(lambda xs: [hash(s) for s in xs]).remote(states))
    if theirs == [hash(s) for s in states]:
        pytest.skip("hash() happens to agree across processes here (PYTHONHASHSEED set, no ASLR)")


def test_fuzz_campaign_over_8_seeds_sums_the_8_runs(
    session: Session, free_cpus: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess
    from types import SimpleNamespace

    seeds = list(range(8))
    # The runs alone in a fresh process, as Ray's workers run them (and `kvretain fuzz` does):
    # under Hypothesis's own settings for the environment, not the profile this suite loaded.
    code = (
        "import json; from invariants.campaign.fuzz import run_one; "
        f"print(json.dumps([(r.counts, r.known) for r in (run_one('model', None, s, 40, None, None, None) "
        f"for s in {seeds})]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    alone = [SimpleNamespace(counts=c, known=k) for c, k in json.loads(done.stdout.strip().splitlines()[-1])]
    js, xml, out = tmp_path / "fuzz.json", tmp_path / "fuzz.xml", tmp_path / "traces"
    argv = [
        "fuzz",
        "--target",
        "model",
        "--ray",
        "local:2",
        "--seeds",
        "0-7",
        "--steps",
        "40",
        "--out",
        str(out),
    ]
    assert main([*argv, "--json", str(js), "--junit-xml", str(xml)]) == 0
    assert "all 8 runs" in capsys.readouterr().out
    cases = json.loads(js.read_text())["cases"]
    assert [c["name"] for c in cases] == [f"model/generated/seed{s}" for s in seeds] + ["model/campaign"]
    assert [c["figures"]["steps"] for c in cases[:-1]] == [r.counts["steps"] for r in alone]
    merged = cases[-1]["figures"]
    for name in ("batches", "examples", "steps", "prompt_tokens", "hit_tokens", "violations"):
        assert merged[name] == sum(r.counts[name] for r in alone), name
    known: dict[str, int] = {}
    for r in alone:
        for row in r.known:
            known[row["finding"]] = known.get(row["finding"], 0) + row["count"]
    assert known, "no known finding met: the ledger merge is untested"
    assert {k["finding"]: k["count"] for k in merged["known"]} == known
    for k in merged["known"]:  # each finding's example trace was written under --out
        assert k["example"] and Path(k["example"]).is_file() and str(out) in k["example"]
    assert xml.read_text().count("<testcase") == 9
    # Control: the runs differ from seed to seed, so a seed dropped or run twice shows.
    assert len({r.counts["steps"] for r in alone}) > 1


def test_explore_command_on_ray(
    session: Session, free_cpus: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "explore.json"
    argv = ["explore", "--ray", "local:2", "--instance", "full-p5-r2", "--depth", "3", "--quiet"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "on Ray (local:2, 2 worker(s))" in capsys.readouterr().out
    cert = json.loads(out.read_text())["cases"][0]["figures"]
    assert cert["new_states_by_depth"] == explore(FULL, ModelTarget, "model", Limits(3)).new_states
    assert cert["restore"] == "live"
    assert main([*argv, "--restore", "pickle", "--json", str(out)]) == 0  # the workers thaw per operation
    again = json.loads(out.read_text())["cases"][0]["figures"]
    assert again["restore"] == "pickle" and again["new_states_by_depth"] == cert["new_states_by_depth"]


@pytest.mark.parametrize(
    "argv",
    [
        ["explore", "--ray", "local:0"],
        ["explore", "--ray", "local:2", "--jobs", "2"],
        ["fuzz", "--ray", "local:2", "--seeds", "5-2"],
        ["fuzz", "--seeds", "0-3"],
        ["fuzz", "--ray", "local:2", "--target", "sglang"],
    ],
)
def test_bad_campaign_input_is_one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err


def test_addresses() -> None:
    assert parse_address("local:3") == (None, 3)
    assert parse_address("auto") == ("auto", None)
    assert parse_address("10.0.0.1:6379") == ("10.0.0.1:6379", None)
    for bad in ("local:x", "local:0", " "):
        with pytest.raises(UsageError):
            parse_address(bad)


def test_the_initial_state_has_one_owner() -> None:
    owners = []
    for i in range(3):
        shard = Shard(i, 3)
        shard.reset(FULL, "model", ModelTarget)
        owned, engine = shard.root()
        owners.append(owned)
        assert not engine  # the model's steps are kvretain's
    assert sum(owners) == 1
