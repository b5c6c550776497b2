"""Errors in a run's configuration or data that the user fixes: ``fly-finetune`` prints them as one line and exits
with status 2, as for a bad option, instead of a traceback. Subclasses of the builtins callers already catch."""

from __future__ import annotations


class RecipeError(ValueError):
    """A configuration or data problem, named in the message with the option to change."""


class RecipePathError(RecipeError, FileNotFoundError):
    """A path option that names nothing usable."""
