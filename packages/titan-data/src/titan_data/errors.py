"""The one error type of titan-data's data checks."""


class DataError(ValueError):
    """The data cannot make batches: a bad row, too few tokens, a source that fails to read, or
    a folder of tokens that does not fit the run. The message names the file (and line or
    token) where there is one, and what to do."""


SKIP_HINT = 'fix or remove the row, or set bad_rows = "skip" to skip such rows and count them'
BAD_ROWS = ("error", "skip")
