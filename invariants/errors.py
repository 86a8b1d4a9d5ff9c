"""Errors every command reports the same way: one line, exit code 2."""


class UsageError(Exception):
    """Bad usage or input: reported in one line, exit code 2."""
