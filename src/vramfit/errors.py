"""The one exception type that reaches the user as a short message instead of a traceback."""


class VramfitError(Exception):
    """Bad input or an unrecoverable run condition.

    `message` says what is wrong; `hint` says what to do about it. The CLI prints both as one
    paragraph and exits non-zero; nothing already written to the run folder is removed.
    """

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 2):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nHINT: {self.hint}"


def damaged_file(path, error: BaseException) -> VramfitError:
    """A file or folder of a finished run that cannot be read (truncated, edited, half-copied)."""
    first = (str(error).splitlines() or [""])[0][:200]
    return VramfitError(f"{path} is damaged and cannot be read ({type(error).__name__}: {first}).",
                        hint="restore the run folder from a copy, or train again under another --run-name "
                             "(its checkpoints/ may still hold the weights)")
