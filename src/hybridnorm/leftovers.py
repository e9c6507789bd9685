"""The hidden temporaries a writer leaves when it is killed outright, and how the next writer clears them.

Every all-or-nothing write here goes through a hidden temporary beside its target, renamed into place at the
end and removed in a ``finally`` on any failure. SIGKILL, the kernel's OOM killer or a power cut run no
``finally``: the temporary stays, and for a tokenized corpus or an exported model it can be gigabytes. So
each temporary is named after its writer (host and pid), and the next write of the same target removes
those whose writer is gone. A live writer's temporary (a concurrent write), another host's (a shared file
system, where this host cannot see the pid) and any name of another form are left alone.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path


def _host() -> str:
    return socket.gethostname().replace(".", "_")


def temp_prefix(name: str, kind: str) -> str:
    """The prefix of a temporary for target ``name``: ``.NAME.KIND-HOST-PID-`` (``tempfile`` adds the rest)."""
    return f".{name}.{kind}-{_host()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, it is someone else's
        return True
    return True


def clear_dead(folder: Path, name: str, kind: str) -> None:
    """Remove the temporaries of target ``name`` in ``folder`` (files or folders made with
    :func:`temp_prefix`) whose writer on this host is gone. Best effort: what cannot be removed stays."""
    pattern = re.compile(rf"\.{re.escape(name)}\.{re.escape(kind)}-{re.escape(_host())}-(\d+)-.+")
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or _alive(int(m.group(1))):
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink()
            except OSError:
                pass
