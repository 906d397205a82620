"""Host memory allocator settings for a training process: keep freed memory for the next step.

glibc's malloc hands every request above its mmap threshold (128 KiB, which it raises as freed blocks teach it,
up to 32 MiB) a fresh mmap and returns it with munmap on free. A training step allocates and frees the same
activations, gradients and GEMM outputs every step, so each of them faults its pages in again, a kernel page
fault and a zeroed page per 4 KiB: on the MID stage of `nanotitan bench pp` a third of the experts' weight
gradients' time went there (docs/pp.md). Pinning the threshold at glibc's maximum and trimming the heap only
past 2 GiB of free top keeps freed blocks mapped for the next step to reuse: what jemalloc and tcmalloc do, and what
PyTorch's CPU performance guide gets by preloading one of them. The price is that the process keeps its peak footprint
mapped (its RSS stays at the peak it reached; the peak itself is unchanged).

Left alone when the process runs another allocator (LD_PRELOAD) or the user set glibc's own MALLOC_* tunables,
or with NANOTITAN_MALLOC=system. CUDA memory is torch's caching allocator's, untouched; host tensors (data,
CPU ranks) are what this serves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
TOP_PAD = 64 * 2**20  # grow the heap in 64 MiB steps, not one brk per request

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc of this process as above (once); True when the settings are in force."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("NANOTITAN_MALLOC", "") == "system" or "LD_PRELOAD" in os.environ:
        return False
    if any(k.startswith("MALLOC_") for k in os.environ) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False  # the user tuned glibc's malloc already
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
        ok = ok and libc.mallopt(M_TOP_PAD, TOP_PAD) == 1
        # M_TRIM_THRESHOLD takes an int here; the largest one is enough never to trim a heap below 2 GiB of
        # free top, and a larger free top is handed back, which is what a user would want anyway.
        ok = ok and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return False
    _done = ok
    return ok
