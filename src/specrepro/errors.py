"""The user-facing error, and how any exception's message becomes one line of it."""

import yaml


class SpecReproError(Exception):
    """A user-facing error: the CLI prints its message as one line and exits non-zero."""


def one_line(exc: Exception) -> str:
    """An exception's message on one line (its type when it has none); a YAML syntax error as its problem and
    position."""
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.YAMLError) and mark is not None:
        return f"YAML syntax error: {exc.problem or exc.context} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split()) or type(exc).__name__
