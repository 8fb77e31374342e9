"""Error taxonomy shared by every layer.

A `RowError` is about one input row (bad media, prompt too long, ...): it is caught
by the job runner and written into that row's `error_type`/`error` columns, and the
job goes on. A `JobError` is about the whole job (missing file, wrong schema, unknown
model): it is raised at submit time, before anything is queued or written.
"""

from __future__ import annotations


class ErrorType:
    """The stable values of the `error_type` result column (users filter on them)."""

    MEDIA_NOT_FOUND = "media_not_found"  # missing file, HTTP 404
    MEDIA_FETCH = "media_fetch_error"  # unreachable host, HTTP 5xx, connection reset
    MEDIA_TIMEOUT = "media_timeout"  # fetch took longer than the configured timeout
    MEDIA_DECODE = "media_decode_error"  # corrupt/truncated bytes, not an image/video
    MEDIA_TOO_LARGE = "media_too_large"  # over the pixel limit or the download size cap
    MEDIA_FORBIDDEN = "media_forbidden"  # private address, domain not allowed, path escape
    UNSUPPORTED_MEDIA = "unsupported_media"  # e.g. a video for a model family without video
    PROMPT_EMPTY = "prompt_empty"
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt + media tokens + max_tokens over the context
    PLACEHOLDER_MISMATCH = "placeholder_mismatch"  # <image> count != number of images
    INVALID_ROW = "invalid_row"  # wrong types, non-UTF-8 text, bad sampling override
    ENGINE = "engine_error"  # the engine failed on this row alone
    STRUCTURED_OUTPUT_INCOMPLETE = "structured_output_incomplete"  # max_tokens reached before the grammar completed
    STRUCTURED_OUTPUT_DEAD_END = "structured_output_dead_end"  # no token could continue the grammar (EOS forced)
    STRUCTURED_OUTPUT_INVALID = "structured_output_invalid"  # the text is not JSON or does not fit the output column's type
    WORKER_CRASH = "worker_crash"  # the row killed its worker process every time (poison)


class RowError(Exception):
    """A failure confined to one input row; becomes that row's error columns."""

    def __init__(self, error_type: str, message: str, param: str | None = None):
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.param = param  # which field/part was at fault (the server reports it)

    def __repr__(self) -> str:
        return f"RowError({self.error_type!r}, {self.message!r})"

    def __reduce__(self) -> tuple:
        """Pickle with all three fields: rows cross process boundaries (preprocessing pool)."""
        return type(self), (self.error_type, self.message, self.param)


class JobError(Exception):
    """A failure of the whole job, reported at submit with a one-line message."""
