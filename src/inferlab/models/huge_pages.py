"""The weights and the K/V cache on 2 MiB pages: what a decode step streams, every step.

Why: a decode step reads every weight and every context's K/V once. On 4 KiB pages that is a
TLB miss and a page walk every 4 KiB of weights and at each of the K/V cache's scattered runs;
a 2 MiB page covers 512 of them. Linux gives anonymous memory huge pages ("transparent huge
pages") when THP is "always", or when it is "madvise" (the usual default) and the range asked
for them before its pages were first touched: so these tensors live in mappings of their own,
2 MiB-aligned and advised, not in malloc's heap (whose pages may be touched already, and which
does not ask). Measured on 2 cores of the Xeon with AMX (THP "madvise"), processes alternated
against the commit before (3 pairs each, every pair faster): the default model's decode step at
32 streams 26.55 / 26.59 / 26.48 -> 24.81 / 24.73 / 25.09 ms, w8a8's 21.13 / 20.84 / 21.82 ->
21.07 / 20.25 / 20.00, one stream 10.05 / 9.97 / 9.91 -> 9.93 / 9.17 / 9.60; as much as glibc's
`glibc.malloc.hugetlb=1` tunable gave the whole process. The K/V cache and only the weights of
2 MB or more: within noise, so the 30 layers' smaller weights come too (MIN_BYTES).

Where THP is "never", or no huge page is free, the same mappings get 4 KiB pages: the tensors
are the same, only their speed differs.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 64 << 10  # smaller weights (norms, scales, tests' tiny models) stay where they are
CHUNK_BYTES = 64 << 20  # a HugeArena's mappings: the weights of several layers each


def _advised(nbytes: int) -> tuple[mmap.mmap, int]:
    """An untouched private anonymous mapping holding nbytes from a 2 MiB-aligned offset (the
    mapping and that offset), its whole huge pages advised. Private: a shared anonymous mapping
    is shmem, whose huge pages follow another setting."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -base % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE  # a partial last page stays small: no 2 MiB page half used
    if whole:
        region.madvise(mmap.MADV_HUGEPAGE, offset, whole)
    return region, offset


def can_advise() -> bool:
    """Whether this platform has madvise(MADV_HUGEPAGE) (Linux)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def empty_huge(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in a mapping of its own on huge pages (torch.empty where it
    could not fill one, or the platform cannot advise)."""
    n = torch.Size(shape).numel() * dtype.itemsize
    if n < HUGE_PAGE or not can_advise():
        return torch.empty(shape, dtype=dtype)
    region, offset = _advised(n)
    # frombuffer holds a reference to `region`: the mapping lives as long as the tensor does.
    return torch.frombuffer(region, dtype=torch.uint8, count=n, offset=offset).view(dtype).view(shape)


def zeros_huge(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """empty_huge, zero-filled: the first touch, where the huge pages are faulted in."""
    return empty_huge(shape, dtype).zero_()


def release_freed() -> None:
    """Hands the heap's freed pages back to the OS (glibc's malloc_trim; elsewhere nothing): the
    weights copied onto huge pages leave their old copies free in malloc's heap, ~240-330 MB of
    the default model's resident memory until then."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


class HugeArena:
    """Copies of tensors laid one after another (64-byte aligned) in CHUNK_BYTES mappings on huge
    pages. Why not one mapping a tensor: a 1 MB weight alone in a 2 MiB page would hold twice its
    bytes; packed, only each chunk's unused tail is lost (never touched, so never resident)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of t in the arena; t itself where it is not on the CPU, is under
        MIN_BYTES, or the platform cannot advise. A copy keeps its chunk alive."""
        if t.device.type != "cpu" or t.nbytes < MIN_BYTES or not can_advise():
            return t
        if self._chunk is None or self._used + t.nbytes > self._chunk.numel():
            size = max(self.chunk_bytes, -(-t.nbytes // HUGE_PAGE) * HUGE_PAGE)
            self._chunk, self._used = empty_huge((size,), torch.uint8), 0
        out = self._chunk[self._used : self._used + t.nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
        self._used += -(-t.nbytes // 64) * 64
        return out
