"""CI outputs: `--junit-xml` and `--json`.

`kvretain verify` writes one JUnit test case per row of its table; a failing
row is a <failure> carrying the path of its replayable trace, an unimportable
row an <error>, a skipped target a <skipped>. The run here keeps the rows
real where they are cheap (fuzzing the reference target and a broken
plug-in, the known-findings recheck) and stands in for the long ones
(theorems, zoo, simulator) with fixed rows: what is under test is that every
row reaches the XML, not those checks.
"""

from __future__ import annotations

import importlib.metadata
import json
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import invariants.cli.verify as verify
import invariants.targets as registry
from invariants.cli.main import main
from invariants.results import CaseResult, junit_xml, results_json
from invariants.zoo.mutants_reference import factory

# A plug-in target with a real bug: freed cached blocks are reused first.
BrokenTarget = factory("cached_blocks_prepended")


def test_junit_structure_and_counts() -> None:
    cases = [
        CaseResult("a", "fuzz", "passed", 1.0, "clean"),
        CaseResult("b", "fuzz", "failed", 2.0, "snapshot: free_queue", trace="t/b.json"),
        CaseResult("c", "zoo", "error", 0.0, "ERROR: cannot import x"),
        CaseResult("d", "fuzz", "skipped", 0.0, "vllm missing"),
    ]
    root = ET.fromstring(junit_xml("kvretain.verify", cases))
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == (
        "4",
        "1",
        "1",
        "1",
    )
    tcs = suite.findall("testcase")
    assert [tc.get("name") for tc in tcs] == ["a", "b", "c", "d"]
    assert tcs[0].find("failure") is None and tcs[0].find("error") is None
    failure = tcs[1].find("failure")
    assert failure is not None and "trace: t/b.json" in (failure.text or "")
    assert tcs[1].find("properties/property[@name='trace']").get("value") == "t/b.json"  # type: ignore[union-attr]
    assert tcs[2].find("error") is not None and tcs[3].find("skipped") is not None
    data = json.loads(results_json("verify", cases, 1))
    assert data["format"] == "kvretain-results" and not data["ok"] and len(data["cases"]) == 4


@pytest.fixture
def cheap_verify(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from hypothesis import Phase, settings

    ep = importlib.metadata.EntryPoint("broken", f"{__name__}:BrokenTarget", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "plugin_targets", lambda: {"broken": ep})
    monkeypatch.setattr(
        verify,
        "available_targets",
        lambda: {
            "model": None,
            "reference": None,
            "broken": None,
            **{t: "vllm: not used by this test" for t in ("vllm", "vllm-async-scheduler", "vllm-manager")},
        },
    )
    real_import = verify.import_row_module

    def rows(module: str, record: Any) -> Any:
        if module == "invariants.proofs.runner":
            return SimpleNamespace(
                run_theorems=lambda progress: [SimpleNamespace(name="t", expected_ok=True)]
            )
        if module == "invariants.cli.zoo":
            return SimpleNamespace(
                verify_row=lambda quick: ("zoo", "reference", "12/12 killed", "-", 0.1, True)
            )
        if module == "invariants.cli.simulate":
            return SimpleNamespace(
                verify_row=lambda quick, out: ("simulate", "reference", "ok", "-", 0.1, True)
            )
        if module == "invariants.cli.sglang":
            return SimpleNamespace(verify_row=lambda budget, seed, out: ("pass", "stub", 0))
        if module == "gpu_check.cli":
            return real_import("gpu_check.no_such_module", record)  # a real ERROR row
        return real_import(module, record)

    monkeypatch.setattr(verify, "import_row_module", rows)
    # No shrinking: which row fails is under test, not the trace's size.
    settings.register_profile("no-shrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])
    previous = settings.get_current_profile_name()
    settings.load_profile("no-shrink")
    yield
    settings.load_profile(previous)


def test_verify_junit_has_one_case_per_row_and_the_failure_trace(
    cheap_verify: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rc = main(
        ["verify", "--quick", "--out", "traces", "--junit-xml", "out/verify.xml", "--json", "out/verify.json"]
    )
    assert rc == 1
    out = capsys.readouterr().out
    table = out[out.index("check ") :].splitlines()
    # The rows: not the verdict lines, nor a clipped cell's note below the table ("[n] ...", wrapped).
    body = [line for line in table[2:] if line.strip() and not line.startswith(("kvretain verify", "[", " "))]
    root = ET.parse(tmp_path / "out" / "verify.xml").getroot()
    (suite,) = root.iter("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == len(body) == int(suite.get("tests", "-1"))
    names = [c.get("name") for c in cases]
    assert names[:1] == ["prove [model]"]
    assert {
        "fuzz [reference]",
        "fuzz [broken]",
        "fuzz [vllm]",
        "zoo [reference]",
        "no_such_module [-]",
    } <= set(names)
    by_name = {c.get("name"): c for c in cases}
    failure = by_name["fuzz [broken]"].find("failure")
    assert failure is not None
    trace = next(
        line[len("trace: ") :] for line in (failure.text or "").splitlines() if line.startswith("trace: ")
    )
    assert (tmp_path / trace).exists() and json.loads((tmp_path / trace).read_text())["target"] == "broken"
    assert by_name["fuzz [reference]"].find("failure") is None
    assert by_name["fuzz [vllm]"].find("skipped") is not None
    assert by_name["fuzz (production scale) [vllm]"].find("skipped") is not None
    assert by_name["conformance [vllm]"].find("skipped") is not None
    assert by_name["production link [vllm]"].find("skipped") is not None
    assert by_name["no_such_module [-]"].find("error") is not None
    assert suite.get("failures") == "1" and suite.get("errors") == "1" and suite.get("skipped") == "7"
    data = json.loads((tmp_path / "out" / "verify.json").read_text())
    assert data["exit_code"] == 1 and [c["name"] for c in data["cases"]] == names


def test_zoo_cases_killed_pass_survivors_fail_na_skipped() -> None:
    from invariants.results import zoo_cases

    def result(name: str, killed: bool, trace: str | None) -> SimpleNamespace:
        return SimpleNamespace(
            name=name,
            target="reference",
            killed=killed,
            check="fuzz: snapshot" if killed else "-",
            note="" if killed else "no check fired",
            seconds=1.0,
            trace_path=trace,
            strategy="generated",
            seconds_to_kill=0.5 if killed else None,
            steps=10,
        )

    report = SimpleNamespace(
        target="reference",
        results=[result("a", True, "z/a.json"), result("b", False, None)],
        not_applicable=[("c", "no such code")],
    )
    root = ET.fromstring(junit_xml("kvretain.zoo", zoo_cases(report, control_ok=False)))
    (suite,) = root.iter("testsuite")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert list(cases) == ["a", "b", "c", "control (unmutated)"]
    assert cases["a"].find("failure") is None and cases["a"].get("classname") == "kvretain.zoo.reference"
    assert cases["b"].find("failure") is not None and cases["c"].find("skipped") is not None
    assert cases["control (unmutated)"].find("failure") is not None
    assert suite.get("failures") == "2" and suite.get("skipped") == "1"


def test_conformance_rows_reach_junit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`conformance --junit-xml`: each feature row is a test case (the vLLM runs stood in for)."""
    import invariants.harness.conformance as conformance

    def fake(steps: int, budget_s: float, seed: int, out: Path, sink: list[Any]) -> int:
        sink.append(conformance.Row("full attention", 3, 100, "agrees", 1.0, True))
        sink.append(conformance.Row("eagle", 2, 50, "FINDING: snapshot", 2.0, False, "t/eagle.json"))
        return 1

    monkeypatch.setattr(conformance, "run_conformance", fake)
    monkeypatch.setattr(registry, "target_factory", lambda name: object)
    xml_path = tmp_path / "c.xml"
    assert main(["conformance", "--junit-xml", str(xml_path)]) == 1
    capsys.readouterr()
    cases = list(ET.parse(xml_path).getroot().iter("testcase"))
    assert [c.get("name") for c in cases] == ["full attention", "eagle"]
    failure = cases[1].find("failure")
    assert failure is not None and "trace: t/eagle.json" in (failure.text or "")


@pytest.mark.parametrize("command", ["fuzz", "verify", "conformance", "zoo"])
def test_bad_output_path_is_one_line_before_anything_runs(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main([command, "--junit-xml", str(tmp_path)]) == 2
    assert main([command, "--json", str(blocker / "out.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "is a directory" in err[0] and "is a file, not a directory" in err[1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
