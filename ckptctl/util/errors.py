"""One exception type per kind of failure; the CLI turns each into an exit status in one place."""

from __future__ import annotations

from pathlib import Path


class CkptctlError(Exception):
    """Base of every error ckptctl reports as a one-line message (exit status 2)."""


class PathError(CkptctlError):
    """An error about one file or directory: `PATH: reason`."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class CheckpointError(PathError):
    """A checkpoint (or a file inside it) is missing, corrupt, hostile or inconsistent."""


class OutputError(PathError):
    """The output cannot be written: permissions, a full disk or quota, an I/O error."""


class UsageError(CkptctlError):
    """The command line asks for something that cannot be done."""


class CastOverflowError(UsageError):
    """A cast asked for (`--dtype`) would turn finite values into inf: refused, never written."""

    def __init__(self, count: int, dtype: str, largest: float) -> None:
        self.count = count
        super().__init__(f"{count} finite value{'s' if count != 1 else ''} beyond {dtype}'s range (±{largest:g}) "
                         "would become inf: keep the source dtype or cast to a wider one")


class IncompleteCheckpointError(CkptctlError):
    """The source has coverage or consistency problems and the command would lose data.
    `allowable` where the command can go on anyway (reshard's `--allow-incomplete`): the message
    then names the option."""

    def __init__(self, path: str | Path, problems: list[str], allowable: bool = False) -> None:
        self.path = str(path)
        self.problems = problems
        first = problems[0] if problems else "unknown problem"
        more = f" (+{len(problems) - 1} more; see `ckptctl inspect --check`)" if len(problems) > 1 else ""
        hint = "; pass --allow-incomplete to go on" if allowable else ""
        super().__init__(f"{self.path}: refusing incomplete checkpoint: {first}{more}{hint}")
