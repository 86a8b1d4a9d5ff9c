"""kvretain's specification, in layers, one subpackage each (issue 39: contract and policy, apart).

- **`model.contract`**: the seeds' mechanisms and the definitions the judges read, as pure
  rules with their release tables (free-queue routing, masks, hits, Eagle margins, Mamba
  checkpoints, the configuration, the operations and observations). What must hold,
  whatever an engine's policy: what a vLLM engineer reads to know the contract.
- **`model.policy`**: where the model predicts one of vLLM's own decisions for the exact
  differential (queue order and the preemption victim, chunk sizes, admission gates,
  draft padding). Each says "vLLM's policy, read from <function> in <release>;
  predicted, no claim to be correct": a target deciding otherwise while keeping every
  contract is POLICY DRIFT, not a defect.
- **`model.machine`**: the executable model that composes both
  (`allocator.AllocatorModel`), the state it keeps, its pool, the connector's and async
  scheduling's bookkeeping, and its declared interfaces (`seams`).
- **`model.radix`**: a second engine's semantics (SGLang's radix cache).

A contract module imports no machine module; `tests/test_model_layers.py` enforces
this map (every module in a layer's subpackage, each policy module's docstring saying so).
"""

CONTRACT, POLICY, MACHINE, SGLANG = "contract", "policy", "machine", "sglang"

# Subpackage of `model/` -> its layer. A module lives in the subpackage of its layer.
LAYERS: dict[str, str] = {
    "contract": CONTRACT,
    "policy": POLICY,
    "machine": MACHINE,
    "radix": SGLANG,
}
