"""`make compiled`: compile `COMPILED`, the hot pure modules, with mypyc into a build directory.

    python -m invariants.native.build [--out DIR]     (default build/mypyc, git-ignored)

The extensions land in DIR only, never beside the sources, with `manifest.json`: per
module the SHA-256 of the source it compiled, the name of the shared library they all
link (`runtime`) and the interpreter's extension suffix. `invariants.compiled` uses the
build only while every hash still matches. Type checking follows no import out of the
compiled set (`follow_imports = skip`): vLLM and torch stay out of the build's mypy run,
and what the compiled code reaches outside it, it reaches as plain Python objects.
A failed build leaves no manifest, so nothing half-built is ever used.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import shutil
import sys
import time
from pathlib import Path

from invariants.compiled import BUILD_DIR, MANIFEST_NAME, PURE_ENV, ROOT, source_hash

# What `make compiled` compiles: the pure modules where the checked path and the search spend
# their time (profiles of `kvretain bench` and `kvretain explore` on vllm-manager) that mypyc
# compiles and the search can still fingerprint. Measured (`kvretain bench --compare-compiled`,
# docs/measurements.md): within the machine's noise of pure Python (+5% at best), so opt-in.
COMPILED: tuple[str, ...] = (
    "model.contract.eagle",
    "model.contract.fine_mamba",
    "model.contract.load_states",
    "model.contract.lookup",
    "model.contract.mamba",
    "model.contract.partial_tails",
    "model.contract.worker_table",
    "model.machine.failed_blocks",
    "model.policy.admission",
    "model.policy.spec_decode",
    "invariants.catalogue.cow",
    "invariants.catalogue.events",
    "invariants.catalogue.headroom",
    "invariants.catalogue.history",
    "invariants.catalogue.incremental",
    "invariants.catalogue.liveness",
    "invariants.catalogue.ordering",
    "invariants.catalogue.promises",
    "invariants.catalogue.retention",
    "invariants.catalogue.steps",
    "invariants.catalogue.structure",
)

# Hot or near it, and left pure Python, each for its reason.
EXCLUDED: dict[str, str] = {
    "model.contract.observation": "BlockKey subclasses a NamedTuple (mypyc compiles no builtin subclass)",
    "model.contract.extra_keys": "Keyed subclasses tuple (mypyc compiles no builtin subclass)",
    "model.contract.config": "ConfigError is subclassed by the targets' pure Python errors",
    "model.contract.smt": "Z3 terms, not on the checked path",
    "model.contract.prefix": "interned prefixes are held by weak references (compiled classes take none)",
    "model.machine.allocator": "AllocatorModel inherits four mixins (mypyc: no multiple inheritance)",
    "model.machine.caching": "a mixin of AllocatorModel, which stays pure Python",
    "model.machine.block_counts": "a mixin of AllocatorModel, which stays pure Python",
    "model.machine.mamba_states": "a mixin of AllocatorModel, which stays pure Python",
    "model.policy.scheduling": "StepChunks is a mixin of AllocatorModel, which stays pure Python",
    "model.machine.seams": "Observer is subclassed by the simulator's and gpu_check's pure Python observers",
    # Classes whose instances the checker's state holds: the search's fingerprint, its in-place
    # restore and its forks read an object's __dict__ (or pickle it); compiled instances have none.
    **{
        m: "defines classes whose instances the checker's state holds (explore reads their __dict__)"
        for m in (
            "model.contract.free_queue",
            "model.contract.hybrid_hit",
            "model.contract.kinds",
            "model.contract.masks",
            "model.contract.ops",
            "model.contract.profile",
            "model.contract.routing",
            "model.machine.async_scheduling",
            "model.machine.connector",
            "model.machine.pool",
            "model.machine.state",
            "model.policy.queues",
            "invariants.catalogue.context",
            "invariants.catalogue.isolation",
        )
    },
    "invariants.explore.fingerprint": "UnknownStateType subclasses TypeError; imports the vLLM target room",
    "invariants.explore.undo": "walks instances' __dict__ and slots, which compiled classes lack",
    "invariants.harness.checker": "the bench and tests wrap its target and model attributes",
    "invariants.catalogue.radix": "SGLang's radix cache only, not on the vLLM path",
    "invariants.targets": "drive vLLM and read its objects (the adapters' own time is vLLM's)",
}


# Type-checked beside the compiled modules, not compiled: what the compiled code calls with
# star-arguments needs its types. Every other module is Any to the build (`follow_imports =
# skip`): compiled code reaches those objects as plain Python objects and checks no attribute
# type of theirs at run time (the checker hands the catalogue duck-typed views of a Snapshot).
TYPED = ("invariants.catalogue.context",)

MYPY_CONFIG = """[mypy]
python_version = 3.11
ignore_missing_imports = True
follow_imports = skip
check_untyped_defs = True
cache_dir = {cache}
"""


def build(out: Path = BUILD_DIR, modules: tuple[str, ...] = COMPILED, root: Path = ROOT) -> float:
    """Compile `modules` (their sources under `root`) into `out`; seconds taken."""
    from mypyc.build import mypycify
    from setuptools import setup

    start = time.monotonic()
    out = out.resolve()
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    work = out / "work"  # kept between builds (mypy's cache, the objects); the rest is rebuilt
    for old in out.glob("*") if out.exists() else ():
        if old != work:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    work.mkdir(parents=True, exist_ok=True)
    # Before compiling: a source edited meanwhile makes the build stale, never wrongly fresh.
    hashes = {m: source_hash(m, root) for m in modules}
    inputs = {m: source_hash(m, root) for m in TYPED if m not in modules}
    config = work / "mypy.ini"
    config.write_text(MYPY_CONFIG.format(cache=work / "mypy_cache"))
    paths = [str(Path(*m.split(".")).with_suffix(".py")) for m in modules]
    typed = [str(Path(*m.split(".")).with_suffix(".py")) for m in TYPED if m not in modules]
    here = os.getcwd()
    os.chdir(root)  # mypyc names modules by their paths relative to the working directory
    try:
        extensions = mypycify(
            ["--config-file", str(config), *paths, *typed],
            only_compile_paths=paths,
            opt_level="3",
            target_dir=str(work / "c"),
        )
        setup(
            name="kvretain-compiled",
            ext_modules=extensions,
            script_args=["-q", "build_ext", "--build-lib", str(out), "--build-temp", str(work / "o")],
        )
    finally:
        os.chdir(here)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    runtime = [p.name.removesuffix(suffix) for p in out.glob(f"*__mypyc{suffix}")]
    manifest = {
        "modules": hashes,
        "inputs": inputs,
        "runtime": runtime[0] if runtime else "",
        "suffix": suffix,
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m invariants.native.build", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=BUILD_DIR, help="the build directory (default build/mypyc)"
    )
    parser.add_argument("--clean", action="store_true", help="remove the build directory first")
    args = parser.parse_args(argv)
    if args.clean:
        shutil.rmtree(args.out, ignore_errors=True)
    try:
        import mypyc  # noqa: F401
    except ImportError:
        print("kvretain: error: mypyc is not installed (it comes with mypy: make setup)", file=sys.stderr)
        return 2
    seconds = build(args.out)
    print(f"compiled {len(COMPILED)} modules with mypyc into {args.out} in {seconds:.0f} s")
    print(f"kvretain uses it while the sources match it; {PURE_ENV}=1 runs pure Python")
    return 0


if __name__ == "__main__":
    sys.exit(main())
