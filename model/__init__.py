"""kvretain's specification, in layers (issue 39: contract and policy, apart).

- **contract**: the seeds' mechanisms and the definitions the judges read, as pure rules
  with their release tables (free-queue routing, masks, hits, Eagle margins, Mamba
  checkpoints, the configuration, the operations and observations). What must hold,
  whatever an engine's policy: what a vLLM engineer reads to know the contract.
- **policy**: where the model predicts one of vLLM's own decisions for the exact
  differential (queue order and the preemption victim, chunk sizes, admission gates,
  draft padding). Each says "vLLM's policy, read from <function> in <release>;
  predicted, no claim to be correct": a target deciding otherwise while keeping every
  contract is POLICY DRIFT, not a defect.
- **machine**: the executable model that composes both (`allocator.AllocatorModel`),
  the state it keeps, its pool, the connector's and async scheduling's bookkeeping, and
  its declared interfaces (`seams`).
- **sglang**: a second engine's semantics (SGLang's radix cache), its own subpackage.

A contract module imports no machine module; `tests/test_model_layers.py` enforces
this map (every module on it, each policy module's docstring saying so).
"""

CONTRACT, POLICY, MACHINE, SGLANG = "contract", "policy", "machine", "sglang"

LAYERS: dict[str, str] = {
    # contract
    "config": CONTRACT,
    "eagle": CONTRACT,
    "extra_keys": CONTRACT,
    "fine_mamba": CONTRACT,
    "free_queue": CONTRACT,
    "hybrid_hit": CONTRACT,
    "kinds": CONTRACT,
    "load_states": CONTRACT,
    "lookup": CONTRACT,
    "mamba": CONTRACT,
    "masks": CONTRACT,
    "observation": CONTRACT,
    "ops": CONTRACT,
    "partial_tails": CONTRACT,
    "prefix": CONTRACT,
    "profile": CONTRACT,
    "routing": CONTRACT,
    "smt": CONTRACT,
    "worker_table": CONTRACT,
    # policy
    "admission": POLICY,
    "queues": POLICY,
    "scheduling": POLICY,
    "spec_decode": POLICY,
    # machine
    "allocator": MACHINE,
    "async_scheduling": MACHINE,
    "caching": MACHINE,
    "connector": MACHINE,
    "failed_blocks": MACHINE,
    "mamba_states": MACHINE,
    "pool": MACHINE,
    "seams": MACHINE,
    "state": MACHINE,
    # a second engine
    "radix": SGLANG,
}
