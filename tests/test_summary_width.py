"""No verify or fuzz summary line is wider than 120 characters (a terminal): a short fuzz
on `model` and `vllm-manager`, printed as `kvretain fuzz` prints it, and the verify table
with the long verdicts and figures real rows carry. Tables fit by clipping their widest
cells (each marked `[n]`, printed in full below); prose lines wrap. Controls: the same
rows through the unfitted table are wider, so the check can fail."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from invariants.cli.main import main
from invariants.cli.verify import VerifyRun
from invariants.report import SUMMARY_WIDTH, fitted_table, table, wrap
from invariants.targets.vllm_env import vllm_available

LONG_VERDICT = "clean (known: vllm-blockstored-token-range x33, eagle-swa-short-run-double-pop x2, cow x1)"
LONG_FIGURE = "1764 steps, 44 examples, 556 states, 24.2% hit rate, 3 batches, 117 ops/s, 9 tolerated crashes"
ROWS = [
    ("fuzz", "vllm-manager", LONG_VERDICT, LONG_FIGURE, "15.0"),
    ("prove", "-", "holds", "12 theorems", "1.0"),
    ("conformance", "vllm", "FAILED: " + "a long reason " * 12, "every row", "3.0"),
]


def too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > SUMMARY_WIDTH]


def test_fitted_table_fits_and_keeps_every_cell() -> None:
    headers = ["check", "target", "verdict", "figure", "seconds"]
    assert too_wide(table(headers, ROWS)), "control: the rows are wider than a terminal unfitted"
    out = fitted_table(headers, ROWS)
    assert not too_wide(out), too_wide(out)
    flat = " ".join(out.split())
    for row in ROWS:  # every clipped cell is printed in full below the table
        for cell in row:
            assert " ".join(cell.split()) in flat or cell in out


def test_wrap_breaks_prose_only_where_too_long() -> None:
    assert wrap("short line") == "short line"
    long = "  - a reason " + "word " * 60
    assert too_wide(long) and not too_wide(wrap(long))
    assert wrap(long).splitlines()[1].startswith("      word")


def test_verify_table_lines_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = VerifyRun(argparse.Namespace(out=str(tmp_path), junit_xml=None, json=None, require=[]))
    for check, target, verdict, figure, seconds in ROWS:
        run.record(check, target, verdict, figure, float(seconds), not verdict.startswith("FAILED"))
    run.skipped("sglang", "sglang", "SGLang is not installed: pip install 'sglang[all]' " + "(details) " * 10)
    capsys.readouterr()
    run.finish()
    out = capsys.readouterr().out
    assert "[1] fuzz: " + LONG_VERDICT[:60] in out
    assert not too_wide(out), too_wide(out)


@pytest.mark.parametrize("target", ["model", "vllm-manager"])
def test_fuzz_output_lines_fit(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything `kvretain fuzz` prints (a violation's report included, if the short run
    finds one) fits; 4 s of fuzzing per target (vLLM's import adds ~15 s on vllm-manager).
    Traces go where a user's do, a short directory under the working one (a path is never
    broken, so a temporary directory's 80-character path would not fit on any terminal)."""
    if target.startswith("vllm") and not vllm_available()[0]:
        pytest.skip(vllm_available()[1])
    monkeypatch.chdir(tmp_path)
    argv = [
        "fuzz",
        "--target",
        target,
        "--budget-s",
        "4",
        "--seed",
        "1",
        "--no-db",
        "--out",
        "kvretain-traces",
    ]
    main(argv)
    out = capsys.readouterr().out
    assert "target" in out and "verdict" in out
    assert not too_wide(out), too_wide(out)


def test_conformance_exclusions_are_one_short_line_each_with_a_docs_anchor() -> None:
    """Each exclusion prints its name and a docs/ anchor (the full text lives in
    docs/conformance-exclusions.md, kept current here). Control: the old form, the whole
    reason on the line, is wider than a terminal."""
    from invariants.harness import conformance

    lines = conformance.exclusion_lines()
    assert len(lines) == len(conformance.EXCLUDED)
    assert not too_wide("\n".join(lines)), too_wide("\n".join(lines))
    assert too_wide("\n".join(f"  - {what}: {why}" for what, why in conformance.EXCLUDED))
    root = Path(__file__).resolve().parent.parent
    doc = (root / conformance.EXCLUSIONS_DOC).read_text()
    assert doc == conformance.exclusions_markdown(), "regenerate: conformance.write_exclusions_doc()"
    headings = {conformance._anchor(h[3:]) for h in doc.splitlines() if h.startswith("## ")}
    for line in lines:
        assert line.rsplit("#", 1)[1] in headings, line
