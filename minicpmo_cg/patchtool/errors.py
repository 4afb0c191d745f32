"""Exit codes and the error that ends a command with a message instead of a traceback."""

from __future__ import annotations

__all__ = ["EXIT_CONFLICT", "EXIT_ERROR", "EXIT_INCOMPLETE", "EXIT_OK", "PROG", "ToolError"]

PROG = "minicpmo-cg-patch"

#: success (for ``check``: apply would succeed)
EXIT_OK = 0
#: refused because of a conflict; nothing was written
EXIT_CONFLICT = 1
#: usage, environment, patch-format, damaged-state or I/O error; nothing was changed (an I/O
#: error while writing was rolled back completely)
EXIT_ERROR = 2
#: an I/O error stopped apply/revert part-way and the roll-back did not finish either; the
#: message lists every file's state, and apply or revert finishes from there
EXIT_INCOMPLETE = 3

EXIT_CODES_HELP = (
    "exit codes: 0 ok; 1 conflict (nothing written); 2 usage, environment, patch-format, damaged "
    "state or I/O error (nothing changed); 3 an I/O error left apply/revert unfinished (each file's state is "
    "listed; run apply or revert again to finish)"
)


class ToolError(Exception):
    """An error that ends the command with a one-paragraph message (no traceback)."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code
