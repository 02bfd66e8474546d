"""Threads for the CPU reads: the cores this process may use, and torch's intra-op thread count.

    available_cores()    # CPUs in this process's affinity mask, capped by a cgroup v2 quota (cpu.max)
    configure()          # kvcert's CLI: torch.set_num_threads(available_cores()) unless the user chose
    read_threads()       # OpenMP threads of one fused read: torch's count, never above available_cores()

torch's default is the machine's core count, blind to an affinity mask (taskset, a container's
cpuset) and to a CPU quota (docker --cpus): in a container given 2 of 64 cores the fused read's
OpenMP loop would start 32 threads on 2 cores. The user's choice wins: with OMP_NUM_THREADS or
MKL_NUM_THREADS set, configure() changes nothing (torch read them at start-up), and a library
call never calls torch.set_num_threads (read_threads only caps what the fused read starts; its
result's bits do not depend on the thread count, fast.core.cpu_fused).
"""

import functools
import math
import os

import torch

ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
CPU_MAX = "/sys/fs/cgroup/cpu.max"


def available_cores(affinity=None, cpu_max=CPU_MAX):
    """Cores this process may run on: len(affinity) (default: os.sched_getaffinity(0), else
    os.cpu_count()), capped by ceil(quota / period) of a cgroup v2 cpu.max ("max" = no quota)."""
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    n = len(affinity)
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):  # no cgroup v2 file here, or one we cannot parse
        pass
    return max(1, n)


@functools.cache
def _cores():
    return available_cores()


def user_chose(environ=None):
    """True when OMP_NUM_THREADS or MKL_NUM_THREADS is set (torch took its thread count from it)."""
    environ = os.environ if environ is None else environ
    return any(environ.get(k, "").strip() for k in ENV)


def configure(environ=None, cores=None):
    """For kvcert's CLI: torch's intra-op threads = the available cores, unless the user set
    OMP_NUM_THREADS / MKL_NUM_THREADS. Returns the thread count torch uses afterwards."""
    if not user_chose(environ):
        n = cores if cores is not None else _cores()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    return torch.get_num_threads()


def read_threads():
    """OpenMP threads for one fused CPU read: torch.get_num_threads(), capped at the available cores."""
    return max(1, min(torch.get_num_threads(), _cores()))
