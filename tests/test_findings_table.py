"""The findings table (docs/findings/README.md) is generated from known_findings.json and
current; every finding says what a user sees, which configurations reach it, its
upstream status (a "none" names the date of the search) and its exported test or why
there is none. Each rule has a control: an entry breaking it is refused by the loader."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from invariants.export import findings_table
from invariants.harness.known_findings import (
    CONSEQUENCES,
    DEFAULT_PATH,
    KnownFindingsError,
    load_known_findings,
    parse_known_findings,
)

ROOT = Path(__file__).resolve().parent.parent
FINDINGS = load_known_findings()


def test_committed_table_is_current() -> None:
    assert findings_table.README.read_text() == findings_table.render_table(), (
        "docs/findings/README.md is stale: python -m invariants.export.findings_table"
    )
    assert findings_table.main(["--check"]) == 0


def test_check_reports_a_stale_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(findings_table.render_table().replace("| crash:", "| hang:", 1))
    monkeypatch.setattr(findings_table, "README", stale)
    assert findings_table.main(["--check"]) == 1


def test_every_finding_has_a_row_with_its_report_fields() -> None:
    table = findings_table.render_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(FINDINGS)
    for f in FINDINGS:
        assert f.consequence.split(":")[0] in CONSEQUENCES and f.reachability, f.id
        (row,) = [r for r in rows if r.startswith(f"| `{f.id}` |")]
        assert f.consequence in row and f.reachability in row
        for ref in f.upstream:
            if re.search(r"\bnone\b", ref):
                assert re.search(r"\d{4}-\d{2}-\d{2}", ref), f"{f.id}: {ref}"


def test_every_pinned_finding_is_exported_or_says_why() -> None:
    for f in FINDINGS:
        path = ROOT / "docs" / "findings" / ("test_" + re.sub(r"\W", "_", f.id) + ".py")
        if "0.33.0" in f.versions and path.exists():
            assert not f.not_exported, f"{f.id}: exported, yet says {f.not_exported!r}"
        else:
            assert f.not_exported.startswith("not exported: "), f"{f.id}: no test and no reason"
    exported = sum(1 for f in FINDINGS if not f.not_exported)
    assert exported == len(list((ROOT / "docs" / "findings").glob("test_*.py")))


def _data() -> dict[str, Any]:
    return copy.deepcopy(json.loads(DEFAULT_PATH.read_text()))


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda e: e.pop("consequence"), "consequence: must start with one of"),
        (
            lambda e: e.update(consequence="bad: a word outside the list"),
            "consequence: must start with one of",
        ),
        (lambda e: e.update(reachability=" "), "reachability: must say which configurations"),
        (lambda e: e.update(upstream=[]), "upstream: name the issues/PRs found"),
        (lambda e: e.update(upstream=["none found"]), "says none was found: name the search date"),
        (lambda e: e.update(not_exported="because"), "not_exported: must start with 'not exported: '"),
    ],
)
def test_loader_refuses_an_entry_breaking_a_report_rule(edit: Any, needle: str) -> None:
    data = _data()
    parse_known_findings(data)  # control: the shipped file loads
    edit(data["findings"][0])
    with pytest.raises(KnownFindingsError, match=re.escape(needle)):
        parse_known_findings(data)


def test_a_none_with_its_search_date_loads() -> None:
    data = _data()
    data["findings"][0]["upstream"] = ["none found, searched 2026-12-06"]
    assert parse_known_findings(data)[0].upstream == ("none found, searched 2026-12-06",)
