"""How many threads the CPU core uses.

The core runs its parallel loops on its own small thread pool (not OpenMP), so this setting never
changes PyTorch's or numpy's threading, and theirs never changes this one. Its workers sleep while
idle, and the calling thread does whatever work no other thread has picked up, so on a machine
whose cores are busy with other processes a call slows down about as much as single-threaded code
would, instead of waiting for descheduled threads. Results are bit-identical for every thread count.
"""

from __future__ import annotations

from . import _core
from ._validate import positive_int


def get_num_threads() -> int:
    """Threads the CPU core uses for one call, the calling thread included.

    The initial value comes from the environment variable ``BLOCKHESS_NUM_THREADS``, else
    ``OMP_NUM_THREADS`` (its first entry), else the number of CPUs this process may run on.
    """
    return int(_core.get_num_threads())


def set_num_threads(n: int) -> None:
    """Set the number of threads the CPU core uses (1 = everything on the calling thread).

    Takes effect from the next call; applies to the whole process. Calls made from several Python
    threads at once share the pool: one of them runs in parallel, the others on their own thread.
    """
    _core.set_num_threads(positive_int(n, "set_num_threads: n", most=int(_core._max_threads)))
