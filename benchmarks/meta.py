"""Where a benchmark ran: host, library versions, and where each implementation came from."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent


def host_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "mem_bytes": mem,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def sources(impls: list[str]) -> dict[str, Any]:
    """Where each implementation was imported from, and the checkout's commit and state."""
    import importlib.util
    import subprocess

    out: dict[str, Any] = {}
    for label in impls:
        name = label.split("#")[0]
        module = "torch.distributed.fsdp" if name == "torch" else name
        try:
            spec = importlib.util.find_spec(module)
            out[label] = spec.origin if spec else None
        except (ImportError, ValueError):
            out[label] = None
    try:
        git = ["git", "-C", str(REPO)]
        out["commit"] = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "fsdp2"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        out["fsdp2_dirty_in_checkout"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        pass
    return out
