# SPDX-License-Identifier: Apache-2.0
"""Run ``minicpmo-cg-patch`` with a fault at one of its file-writing steps (a test helper).

    python hookrun.py FAULT STEP N [--from] -- TOOL ARGS...

FAULT: ``kill`` (SIGKILL to the process itself: nothing runs afterwards) or an errno name
(``EIO``, ``EACCES``, ``ENOSPC``: the step raises that ``OSError``). STEP: a step name of
:mod:`minicpmo_cg.patchtool.fsops` (``tmp-create``, ``tmp-write``, ``rename``, ``unlink``,
``mkdir``, ``rmdir``) or ``any``. N: the fault hits the N-th such step (1-based); with
``--from`` every later one too. Prints ``steps: <count>`` to stderr when it exits normally,
so a test can count the steps of a run with an N that is never reached.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

from minicpmo_cg.patchtool import cli, fsops


def main(argv: list[str]) -> int:
    split = argv.index("--")
    fault, step, nth, *flags = argv[:split]
    tool_args = argv[split + 1 :]
    target, from_on = int(nth), "--from" in flags
    seen = 0

    def hook(name: str, path) -> None:
        nonlocal seen
        if step not in ("any", name):
            return
        seen += 1
        if seen == target or (from_on and seen > target):
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            code = getattr(errno, fault)
            raise OSError(code, f"{os.strerror(code)} (injected at {name})", str(path))

    fsops.set_hook(hook)
    code = cli.run(tool_args)
    sys.stderr.write(f"steps: {seen}\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
