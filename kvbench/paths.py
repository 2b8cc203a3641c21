"""Paths the user names: stat'ed and checked before any work, failing as one line.

Every command checks each path it will write (`check_out`) before it measures anything,
so an unusable `--out` costs nothing; reading commands stat their inputs through `stat`,
which turns the OS's refusals (a name too long, a component that is a file, no
permission) into a KvbenchError naming the path.
"""

from __future__ import annotations

import os
import stat as st
import tempfile
from pathlib import Path

from kvbench.errors import KvbenchError

_SHOWN = 80  # characters of a path an error line shows
RESULTS_DIR = Path("results")  # where a command stores its records without --out


def shown(path: Path | str) -> str:
    """The path as an error line shows it: long ones cut in the middle."""
    s = str(path)
    return s if len(s) <= _SHOWN else f"{s[:_SHOWN // 2]}...{s[-_SHOWN // 2:]}"


def stat(path: Path | str, what: str) -> os.stat_result | None:
    """os.stat of `path`, None where nothing is there; KvbenchError ("{what} 'PATH': why")
    when the OS refuses to look (name too long, a file where a folder should be, ...)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise KvbenchError(f"{what} '{shown(path)}': {e.strerror or e}") from None


def check_out(path: Path | str, what: str = "--out", folder: bool = False,
              parents: bool = True) -> os.stat_result | None:
    """KvbenchError unless `path` can be written: a file (appended to or created) or, with
    `folder`, a folder (created if need be) written into. A path not there yet needs its
    nearest existing folder to take a new file (tried: a nameless temporary file), and with
    `parents` False its own folder must exist (the writer creates none). Returns the stat
    of what is there (None: nothing yet); store.check_results_out checks a result file's
    content."""
    kind = "folder" if folder else "file"
    found = stat(path, what)
    if found is not None:
        if st.S_ISDIR(found.st_mode) != folder:
            raise KvbenchError(f"{what} '{shown(path)}' is "
                               f"{'not a folder' if folder else 'a folder'}: give a {kind} path")
        if not os.access(path, os.W_OK):
            raise KvbenchError(f"{what} '{shown(path)}': {kind} is not writable")
        return found
    parent = Path(os.path.abspath(path)).parent
    while (up := stat(parent, what)) is None:
        if not parents:
            raise KvbenchError(f"{what} '{shown(path)}': folder '{shown(parent)}' does not "
                               "exist")
        parent = parent.parent
    if not st.S_ISDIR(up.st_mode):
        raise KvbenchError(f"{what} '{shown(path)}': '{shown(parent)}' is not a folder")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise KvbenchError(f"{what} '{shown(path)}': cannot write in '{shown(parent)}' "
                           f"({e.strerror or e})") from None
