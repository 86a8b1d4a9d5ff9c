"""Everything that judges an allocator, in rooms named for what they do.

| room         | what lives there                                                        |
|--------------|-------------------------------------------------------------------------|
| `catalogue/` | the invariants: each a named function, its reason and its PR            |
| `targets/`   | one adapter protocol over every allocator under test (model, reference, |
|              | vllm, vllm: vLLM's real Scheduler, entry-point plug-ins);     |
|              | SGLang's radix cache (`sglang_*.py`)                                    |
| `layouts/`   | presets, and their derivation from vLLM's own grouping code             |
| `harness/`   | checker, stateful machine, strategies, fuzz runner, traces, replay,     |
|              | known findings, conformance rows, the checked-vs-raw benchmark          |
| `proofs/`    | Z3 theorems by subject, their runner, the production link, CrossHair    |
| `zoo/`       | mutants that re-create real bug classes, and the hunt that kills them   |
| `simulate/`  | the serving simulator (one scheduler loop with observers), scenarios,   |
|              | retention settings, verdicts per seed claim                             |
| `export/`    | a finding as a standalone vLLM pytest file and an upstream report       |
| `matrix/`    | the release matrix: one cached environment per vLLM release, checks run |
|              | there, every disagreement classified (defect, predates, semantics, ...) |
| `explore/`   | exhaustive small-scope search: every operation sequence to a depth over |
|              | a grid of small instances, fingerprints, shortest traces, certificates  |
| `shadow/`    | the engine's contract: a shadow model runner over real scheduler        |
|              | outputs with a provenance per KV slot, and the scheduler's queues       |
| `campaign/`  | long runs on a Ray cluster (the optional extra; nothing else imports    |
|              | Ray): explore's frontier by fingerprint over workers, fuzz seeds merged |
| `native/`    | `make compiled`: the hot pure modules compiled with mypyc (opt-in)      |
| `cli/`       | the `kvretain` command, one module per command group                    |

`errors` (usage errors), `report` (tables, progress lines) and `results` (JUnit
XML and JSON for CI) are leaves that any room may use, and so is `compiled` (the opt-in
mypyc build, chosen at import). A room imports only the rooms listed for it in `ROOMS`, so
the judge reads bottom-up: the catalogue and targets know nothing of the
harness, and nothing but `cli/` knows the command line. `tests/test_layers.py`
enforces this map, and the layer rules between `model/`, `reference_impl/`,
`invariants/` and `gpu_check/`. `gpu_check/` imports the judge, never the
reverse: `kvretain gpu-check` and its `verify` row come through the
`kvretain.commands` entry point (pyproject.toml), which is all `cli/` knows.
"""

from invariants import compiled as _compiled

_compiled.install()  # first: the opt-in mypyc build, all its modules or none (`invariants.compiled`)

LEAVES: frozenset[str] = frozenset({"errors", "report", "results", "compiled"})

# room -> the rooms it may import (besides itself and the leaves).
ROOMS: dict[str, frozenset[str]] = {
    "catalogue": frozenset(),
    "shadow": frozenset(),
    "targets": frozenset({"shadow"}),
    "layouts": frozenset({"targets"}),
    "proofs": frozenset(),
    "harness": frozenset({"catalogue", "targets", "layouts"}),
    "zoo": frozenset({"catalogue", "targets", "layouts", "harness", "explore"}),
    "simulate": frozenset({"targets", "layouts", "harness", "zoo"}),
    "export": frozenset({"catalogue", "targets", "harness"}),
    "matrix": frozenset({"targets", "layouts", "harness"}),
    "explore": frozenset({"catalogue", "targets", "harness"}),
    "campaign": frozenset({"catalogue", "targets", "layouts", "harness", "explore"}),
    "native": frozenset({"catalogue", "targets", "harness", "explore"}),
    "cli": frozenset(
        {
            "catalogue",
            "targets",
            "layouts",
            "harness",
            "proofs",
            "zoo",
            "simulate",
            "export",
            "matrix",
            "explore",
            "shadow",
            "campaign",
        }
    ),
}
