"""One exception family. Every message names where the problem is: file, row, field."""

from __future__ import annotations


class LeanSFTError(Exception):
    """Base error. The CLI prints ``str(err)`` without a traceback and exits non-zero."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        row: int | None = None,
        field: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.file = file
        self.row = row
        self.field = field
        self.hint = hint
        super().__init__(self.__str__())

    def __reduce__(self):
        """Picklable with its fields (errors raised in data-preparation workers reach the main process whole)."""
        return _rebuild, (type(self), self.message, self.file, self.row, self.field, self.hint)

    def __str__(self) -> str:
        where = []
        if self.file is not None:
            where.append(str(self.file))
        if self.row is not None:
            where.append(f"row {self.row}")
        if self.field is not None:
            where.append(f"field '{self.field}'")
        text = (": ".join(where) + ": " if where else "") + self.message
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


def _rebuild(cls, message, file, row, field, hint) -> LeanSFTError:
    return cls(message, file=file, row=row, field=field, hint=hint)


class DataError(LeanSFTError):
    """A data file, row or field is missing or malformed."""


class TemplateError(LeanSFTError):
    """A chat template cannot render a conversation or cannot mark assistant turns."""


class ConfigError(LeanSFTError):
    """A config key is unknown, has the wrong type, or points at something missing."""


class ModelError(LeanSFTError):
    """A model or tokenizer cannot be loaded or is used in a way that would be wrong."""


class PeerFailure(LeanSFTError):
    """Another rank stopped answering or ended. The process ends at once after saying so: the process group's
    teardown (and the pending collective's destructor) would wait on the peer that is gone."""
