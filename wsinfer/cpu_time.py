"""CPU time as Linux's ``/proc`` counts it: a process's, and its cores'.

Read by ``wsinfer serve`` (is the engine at work? ``standby_pacing``) and by a
CPU engine (how much of its cores do others use? ``engine/cpu_threads.py``).
Each returns None where ``/proc`` cannot be read: the callers then leave things
as they are.
"""

from __future__ import annotations

import os

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int | str = "self") -> float | None:
    """CPU seconds the process has used (all its threads)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # After the command name (which may hold spaces and parentheses): state is
    # the 1st field, utime and stime the 12th and 13th.
    fields = text.rsplit(b")", 1)[-1].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    except (IndexError, ValueError):
        return None


def busy_core_seconds(cores: frozenset[int]) -> float | None:
    """Seconds ``cores`` have been busy, whoever kept them so."""
    try:
        with open("/proc/stat", "rb") as stat:
            lines = stat.read().splitlines()
        busy = 0
        for line in lines:
            name, *values = line.split()
            if not name.startswith(b"cpu") or name == b"cpu" or int(name[3:]) not in cores:
                continue
            ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(ticks) - ticks[3] - ticks[4]  # stolen by a hypervisor is not ours either
    except (OSError, ValueError, IndexError):
        return None
    return busy / _TICKS_PER_S
