"""Modules a worker imports while it serves. An import inside a step holds the loop for as long
as it takes to read, compile and run the module and what it imports in turn (tens of ms for a
large package without compiled bytecode), and it happens at the first request that takes the
code path: a stall nobody measured at startup. `LateImports` remembers the modules loaded when the
worker became ready; `check()` (one `len(sys.modules)` a call, cheap enough for every step) names
those loaded since, so that the worker can log them and they can be imported at startup.
"""

from __future__ import annotations

import sys


class LateImports:
    def __init__(self) -> None:
        self._known = set(sys.modules)
        self._count = len(sys.modules)

    def check(self) -> list[str]:
        """The modules imported since the last call (or since this was made), sorted; [] at once
        when none was."""
        if len(sys.modules) == self._count:
            return []
        now = set(sys.modules)
        new = sorted(now - self._known)
        self._known, self._count = now, len(now)
        return new


def describe(names: list[str], most: int = 12) -> str:
    """`names` for a log line: the packages they belong to first (a package pulls in many
    submodules), then at most `most` of the module names."""
    roots = sorted({n.split(".")[0] for n in names})
    shown = ", ".join(names[:most]) + (f" (+{len(names) - most} more)" if len(names) > most else "")
    return f"{len(names)} modules of {', '.join(roots)}: {shown}"
