"""The host memory this process may use: the machine's physical memory or, when smaller, the
limit of the cgroup it runs in (a container's, a Slurm job's).

    size, source = host_memory_bytes()    # 2.1e12, "/proc/meminfo MemTotal"
    size, source = host_memory_bytes(root=str(tmp_path))   # tests: the same files under tmp_path

Physical memory is /proc/meminfo's MemTotal (else os.sysconf). The cgroup limits are read for
every cgroup the process is in (from /proc/self/cgroup) and each of its ancestors up to the
mount point, since any of them can hold the limit that applies: cgroup v2 memory.max ("max": none)
under /sys/fs/cgroup, v1 memory.limit_in_bytes under /sys/fs/cgroup/memory (no limit reads as
9223372036854771712). A limit at or above physical memory limits nothing and is not reported.
"""

from __future__ import annotations

import os

V2_MOUNT = "sys/fs/cgroup"
V1_MOUNT = "sys/fs/cgroup/memory"
V2_FILE = "memory.max"
V1_FILE = "memory.limit_in_bytes"


def physical_memory_bytes(root: str = "/") -> tuple[int, str]:
    """MemTotal from root/proc/meminfo, else os.sysconf's page count (of this machine)."""
    path = os.path.join(root, "proc/meminfo")
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024, "/proc/meminfo MemTotal"  # kB
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages, "os.sysconf physical pages"


def cgroup_paths(root: str = "/") -> dict[str, str]:
    """{"v2": path, "v1": path} of this process's cgroups from root/proc/self/cgroup ("/" when
    the file or a line is missing, e.g. inside a container that shows only its own cgroup)."""
    paths = {"v2": "/", "v1": "/"}
    path = os.path.join(root, "proc/self/cgroup")
    if not os.path.isfile(path):
        return paths
    with open(path) as f:
        for line in f:
            _, controllers, where = line.rstrip("\n").split(":", 2)
            if controllers == "":
                paths["v2"] = where
            elif "memory" in controllers.split(","):
                paths["v1"] = where
    return paths


def cgroup_dirs(mount: str, path: str) -> list[str]:
    """The mount point and each directory of `path` below it that exists, outermost first."""
    parts = [p for p in path.split("/") if p]
    dirs = [os.path.join(mount, *parts[:i]) for i in range(len(parts) + 1)]
    return [d for d in dirs if os.path.isdir(d)]


def read_limit(path: str) -> int | None:
    """A limit file's bytes; None for a missing file, "max" or anything not a number."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    return int(text) if text.isdigit() else None


def host_memory_bytes(root: str = "/") -> tuple[int, str]:
    """(bytes this process may use, where the number comes from): the smallest of physical
    memory and every cgroup memory limit that applies (see the module docstring)."""
    size, source = physical_memory_bytes(root)
    paths = cgroup_paths(root)
    for version, mount, name in (("v2", V2_MOUNT, V2_FILE), ("v1", V1_MOUNT, V1_FILE)):
        for d in cgroup_dirs(os.path.join(root, mount), paths[version]):
            limit = read_limit(os.path.join(d, name))
            if limit is not None and limit < size:
                where = "/" + os.path.relpath(os.path.join(d, name), root)
                size, source = limit, f"cgroup {version} limit {where}"
    return size, source
