"""A kvretain target package: a fork's allocator and its adapter."""
