"""The user-facing error, and how any exception's message becomes one line of it."""

import sys

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


def as_user_error(exc: Exception) -> SpecReproError | None:
    """`exc` as the error a user can act on: itself, or a third-party module that is not installed (a lean
    environment, e.g. a lent GPU machine's, that lacks one of the dependencies a metric or method imports when it
    runs); None for anything else, a bug."""
    if isinstance(exc, SpecReproError):
        return exc
    if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.partition(".")[0] != "specrepro":
        return SpecReproError(
            f"the Python module '{exc.name}' is not installed in {sys.executable}: install specrepro's "
            "dependencies (pip install -e . -c constraints.txt)"
        )
    return None
