"""vLLM's policies, predicted for the exact differential: each module names the vLLM function and
release it was read from and claims no correctness; a target deciding otherwise is policy drift."""
