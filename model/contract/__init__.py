"""The contract: what must hold, whatever an engine's policy (the seeds' mechanisms as pure rules
with their release tables, and the definitions the judges read). Imports no `model.machine`."""
