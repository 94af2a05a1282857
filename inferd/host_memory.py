"""What memory the host can give: read by the KV pool's sizing and by caches of packed weights."""

from __future__ import annotations

GIB = 1 << 30


def available_bytes() -> int:
    """Memory the OS can give without swapping (MemAvailable), or a modest 4 GiB guess where
    /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GIB
