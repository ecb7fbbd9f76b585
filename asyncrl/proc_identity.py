"""Which process a pid names: its start time from ``/proc/<pid>/stat`` (Linux), torch-free.

A pid alone does not name a process: once it ends, the kernel hands the same pid to a later one. The pid
with its start time (field 22 of ``/proc/<pid>/stat``, clock ticks after boot, fixed for the process's
life, exec included) does. The sweep records it to tell whether a run dir's ``asyncrl run`` is still
alive (asyncrl.sweep), the shm transport to tell a dead learner's weights from a live one's
(asyncrl.learner.shm_transport).

Parsing: field 2 (comm, the executable's name) is in parentheses and may itself hold spaces, ``)`` and
``(`` (and any byte but NUL), so the fields are counted from the *last* ``)``: after it come field 3
(the state) to the end, field 22 being the 20th of them. The file is read as bytes, since a comm need not
be UTF-8.
"""

from __future__ import annotations

__all__ = ["start_time"]

#: States of a process that has ended: only its exit status is left for its parent to collect.
_ENDED = (b"Z", b"X")


def start_time(pid: int, *, zombies: bool = False) -> int | None:
    """When process ``pid`` started (clock ticks after boot), which tells it from a later process given the
    same pid; None if there is none, or no /proc. A zombie (ended, not yet waited for) counts as none
    unless ``zombies``: the sweep asks whether its run still runs, the shm transport whether the pid was
    reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    _comm, paren, fields_after = stat.rpartition(b")")
    fields = fields_after.split()
    if not paren or len(fields) < 20:  # not a stat line (never seen from Linux): no process known
        return None
    if not zombies and fields[0] in _ENDED:
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None
