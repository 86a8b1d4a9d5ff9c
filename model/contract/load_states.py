"""The states of a request's KV connector load (`RequestState.load`, `model.machine.connector`):
none (""), in flight, reported and waiting for its promotion, failed (to be re-admitted)."""

LOADING, LOADED, FAILED = "loading", "loaded", "failed"
