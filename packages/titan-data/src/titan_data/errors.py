"""The error type of titan-data's data checks."""

from __future__ import annotations


class DataError(ValueError):
    """The data cannot make batches: a bad row, too few tokens, a source that fails to read, or
    a folder of tokens that does not fit the run. The message names the file (and line or
    token) where there is one, and what to do."""


class MissingTextField(DataError):
    """A dataset's first row has no field of the name the text is read from (`text_field`):
    most likely another field holds the text. The advice names `option`, the setting that
    chooses the field where the caller reads it: `for_option` gives the same error naming
    another (a command-line flag, a config key)."""

    def __init__(self, problem: str, option: str = "text_field"):
        self.problem, self.option = problem, option
        super().__init__(f"{problem}\nset {option} to the field that holds the text")

    def for_option(self, option: str) -> MissingTextField:
        return MissingTextField(self.problem, option)


SKIP_HINT = 'fix or remove the row, or set bad_rows = "skip" to skip such rows and count them'
BAD_ROWS = ("error", "skip")
