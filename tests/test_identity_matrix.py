"""The identity-field table across vLLM releases (`invariants/matrix/identity_keys.py`).

docs/identity-matrix.md is the command's output, kept current. The table's rows are held
to every installed release's source (`disagreements`) and, by hashing real requests with
that release's own functions, to its behaviour (`probe_disagreements`); each with a
planted contradiction as its control.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from invariants.matrix import identity_keys as ik

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "identity-matrix.md"


def test_the_doc_is_the_commands_output(capsys: pytest.CaptureFixture[str]) -> None:
    from invariants.cli.main import main

    assert main(["matrix", "--identity-table"]) == 0
    printed = capsys.readouterr().out
    assert printed == ik.render_table()
    assert DOC.read_text() == printed, (
        "regenerate: kvretain matrix --identity-table > docs/identity-matrix.md"
    )


def test_every_field_and_release_is_covered() -> None:
    assert {c.field for c in ik.CHANGES} <= set(ik.FIELDS)
    assert ik.RELEASES[0] == ik.FIRST and ik.RELEASES[-1] == ik.MODELED
    assert ik.changes_at(ik.MODELED) == []  # the modeled release hashes every field as stated
    for c in ik.CHANGES:
        assert c.first in ik.RELEASES and c.last in ik.RELEASES and "#" in c.refs, c
        assert (c.field, c.first) in ik.ROW_FEATURE, c
    table = ik.render_table()
    assert (
        "| 0.30.0 | cache_salt, lora, multimodal, prompt_embeds, lookahead | cache_salt, lora, multimodal |"
        in table
    )
    assert "| 0.31.0 | lookahead | none |" in table


def _installed() -> dict[str, str]:
    found = ik.installed_sources()
    if not found:
        pytest.skip("no vLLM release installed")
    return found


def test_installed_sources_agree_with_the_table() -> None:
    for version, path in _installed().items():
        assert ik.disagreements(version, Path(path).read_text()) == [], version


def test_a_row_the_source_contradicts_is_reported() -> None:
    """Control: 0.33.0's source read as an old release's (tagged keys, the LoRA path, the
    multimodal window, lookahead) contradicts every row the table claims for it."""
    text = Path(next(iter(_installed().values()))).read_text()
    modern = ik.source_features(text)
    if not all(modern.values()):
        pytest.skip("needs an installed release with every 0.33.0 feature")
    found = ik.disagreements("0.22.0", text)
    assert len(found) == len(ik.changes_at("0.22.0")), found


@pytest.mark.vllm
@pytest.mark.parametrize("version", sorted(ik.installed_sources()) or ["none"])
def test_real_hashes_share_exactly_where_the_table_says(version: str) -> None:
    """One matrix run per installed release: the probes hash two requests per identity pair
    with the release's own Request and block hasher (a subprocess in its environment: tens of
    seconds, most of it importing vLLM). Where the table says a field let requests share,
    they share; the controls (other salts, adapters, items) never do."""
    if version == "none":
        pytest.skip("no vLLM release installed")
    shared = ik.run_probes(version)
    assert ik.probe_disagreements(version, shared) == [], shared


def test_a_probe_that_contradicts_the_table_is_reported() -> None:
    """Control: probe results flipped from what the table claims are each reported."""
    for version in ("0.23.0", "0.33.0"):
        claimed = {c.probe for c in ik.changes_at(version) if c.probe and c.shares.startswith("yes")}
        names = {c.probe for c in ik.CHANGES if c.probe} | set(ik.CONTROLS)
        flipped = {n: n not in claimed for n in names if n is not None}
        assert len(ik.probe_disagreements(version, flipped)) == len(flipped)
        assert ik.probe_disagreements(version, {}) != []  # probes that did not run
