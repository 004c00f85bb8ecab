"""The host a result was measured on: CPU, threads, load, and the process's host peak."""

from __future__ import annotations

import os
import platform
import resource
import sys
import time


def vm_hwm_bytes() -> int | None:
    """This process's peak resident memory (``VmHWM``), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def max_rss_bytes() -> int:
    """The largest resident set this process had (``getrusage``; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def meta(**extra) -> dict:
    """What a result's ``meta`` records of the machine and the run."""
    import torch
    import pscompile
    return {"torch": torch.__version__, "pscompile": pscompile.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
            "loadavg_start": loadavg(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv[1:], **extra}
