class SpecReproError(Exception):
    """A user-facing error: the CLI prints its message as one line and exits non-zero."""
