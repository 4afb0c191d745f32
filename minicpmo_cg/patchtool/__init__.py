"""``minicpmo-cg-patch``: install the MiniCPM-o 4.5 encoder CUDA graph patch set into vllm-omni / vLLM.

Usage::

    minicpmo-cg-patch {apply,check,status,revert} [--site-packages DIR] [--patches-dir DIR]
                      [--owned-dir DIR] [--json] [--verbose]
    minicpmo-cg-patch base [--before PATCH] [--out DIR] [FILE ...]
    minicpmo-cg-patch index [--write | --check] [--patches-dir DIR]
    python -m minicpmo_cg.patchtool ...            # same

Commands:

- ``status``  table of every patch (state per target file), the owned files, installed
  versions and lane, in 120 columns (``--verbose``: every detail and each file's state);
  exits 0 unless the environment is unusable.
- ``check``   the same as a dry run of ``apply``: 0 when every patch is
  applied/upstream/pending/n/a and the owned files are installable, 1 on any conflict.
- ``apply``   all-or-nothing: every new file content is computed in temporary
  directories first; only when all active patches apply (each hunk at exactly one place)
  are the files written, through the journal below. A second apply changes nothing.
- ``revert``  restores every file apply changed, byte-identical, removes the owned
  files and the state directory; refuses (exit 1, nothing written) when a file was
  modified after apply or cannot be restored.
- ``base``    writes ``DIR/a/FILE`` and ``DIR/b/FILE``: FILE's pre-apply content with the
  active patches of the series applied, all of them or those before ``--before PATCH``,
  the starting point to diff a new or refreshed patch from.
- ``index``   the one-page ``patches/INDEX.md`` generated from the patch headers.

Exit codes: 0 ok; 1 conflict (nothing written); 2 usage, environment, patch-format, damaged
state or I/O error (nothing changed; a message, never a traceback); 3 an I/O error stopped apply/revert part-way and the roll-back
failed too (each file's state is listed; apply or revert finishes). An output that cannot
be written (stdout closed, full or a closed pipe) never changes the exit code.

Crash safety (checkable against :mod:`.journal` and ``tests/patches/test_crash_safety.py``):
every file is replaced by rename (:mod:`.fsops`), so it holds its old or its new bytes at any
instant, and hard links shared with other installations are never written through. Before
the first file changes, ``apply`` and ``revert`` store each touched file's pre-apply bytes
and write a journal (``state.json``, ``complete: false``) naming every content each touched
file may hold until the end; only then are the files replaced, and the journal is committed
(``complete: true``, or removed by revert) after the last one; stored originals are deleted
only after that commit. Hence at every instant each file the journal names holds a content
it lists, with its original stored, and nothing else was changed: after a kill at any step
``status`` describes each file truthfully and ``apply`` or ``revert`` both finish, leaving the
installation byte-identical to applied or to pristine; temporary files of a killed run are
removed by the next apply/revert. Without a record, pristine is what the installed wheels'
RECORD hashes say; a file that is neither pristine nor explained by the series is a conflict,
never half-reverted. Symbolic links (a target, or a directory on its way) are refused with a
message, never written through or replaced. Nothing read back is trusted: the state directory
and the directories below it must not be links, ``state.json`` and every file read must be
regular files (a FIFO is refused, never waited on), and every path the record names must lie
inside ``vllm/`` or ``vllm_omni/`` and resolve there, every link on its way followed
(:mod:`.state`); otherwise the state is damaged (exit 2). Nothing is deleted through a link.
Malformed input (the record, the series, ``INDEX.md``, the dist-info ``METADATA``/``RECORD``) is
one line naming the file (exit 2); GNU patch failing without a conflict (it cannot write, is
killed or hangs) is an I/O error naming ``TMPDIR`` or the file size limit (exit 2).

Commands on one installation are serialised by an ``flock`` on its site-packages directory; one
that has to wait says whose lock it waits for (``waiting for the lock held by PID ...``) at once,
and ``MINICPMO_CG_LOCK_TIMEOUT=S`` makes it give up after S seconds (exit 2).

The installation is the site-packages directory holding the importable ``vllm`` and
``vllm_omni`` (found with :func:`importlib.util.find_spec`, without importing them), or
``--site-packages``. Only the pairs of :mod:`minicpmo_cg.lanes` are accepted. The series format,
the states and the algorithm are described in ``patches/README.md``.

The tool prints reports (stdout) and errors (stderr); it does not import vLLM (whose import
takes ~10 s), so it has no vLLM logger.
"""

from __future__ import annotations

from minicpmo_cg.patchtool.cli import main, run
from minicpmo_cg.patchtool.errors import EXIT_CONFLICT, EXIT_ERROR, EXIT_INCOMPLETE, EXIT_OK, ToolError
from minicpmo_cg.patchtool.install import Installation, discover_installation
from minicpmo_cg.patchtool.plan import build_plan
from minicpmo_cg.patchtool.views import ADAPTER_STATES, OWNED_STATES, PATCH_STATES, Plan

__all__ = [
    "ADAPTER_STATES",
    "EXIT_CONFLICT",
    "EXIT_ERROR",
    "EXIT_INCOMPLETE",
    "EXIT_OK",
    "OWNED_STATES",
    "PATCH_STATES",
    "Installation",
    "Plan",
    "ToolError",
    "build_plan",
    "discover_installation",
    "main",
    "run",
]
