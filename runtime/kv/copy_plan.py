"""Byte ranges of a host-tier page transfer: a run of pages becomes one copy per part.

Every pool on the runner's page ids is page-major ([num_pages, *page], one pool per part: the main KV
pool, the MTP head's, each attached pool such as a DFlash drafter's), so device pages p..p+n-1 of a part
are one byte range. A host chunk (one pinned buffer of the arena) is part-major: for a chunk of N pages,
part 0's N pages, then part 1's, and so on, so host pages i..i+n-1 of a chunk are one byte range of each
part too. A transfer between a device page list and an allocation's extents therefore needs one copy per
part per run: a maximal stretch where the device page id and the host page both advance by one, inside
one chunk. Copying page by page paid Python, view and driver overhead per ~1 MB page, about as much time
as the page's bytes take at the pinned copy rate.

Pure functions over integers: no buffers, no device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class PagePart:
    """One pool on the page ids: a name for the counters and its bytes per page."""

    name: str
    page_bytes: int


@dataclass(frozen=True)
class PageRun:
    """Device pages dev_page..dev_page+n-1 <-> host pages host_page..host_page+n-1 of one chunk."""

    dev_page: int
    chunk: int
    host_page: int  # within the chunk
    n: int


@dataclass(frozen=True)
class ByteCopy:
    """One copy: nbytes at dev_offset of part `part`'s device pool <-> at host_offset of chunk `chunk`."""

    part: int  # index into the parts list
    dev_offset: int
    chunk: int
    host_offset: int
    nbytes: int


def page_runs(dev_pages: Sequence[int], host_pieces: Sequence[tuple[int, int, int]]) -> list[PageRun]:
    """Maximal runs pairing dev_pages (logical order) with host_pieces: (chunk, first page within the chunk,
    pages), the allocation's extents in logical order, cut at chunk boundaries."""
    total = sum(n for _, _, n in host_pieces)
    if total != len(dev_pages):
        raise ValueError(f"{len(dev_pages)} device pages for a host allocation of {total} pages")
    if dev_pages and min(dev_pages) < 0:
        raise ValueError(f"negative device page id {min(dev_pages)}")
    runs: list[PageRun] = []
    i = 0
    for chunk, first, n in host_pieces:
        if n <= 0 or first < 0:
            raise ValueError(f"bad host piece (chunk {chunk}, first page {first}, {n} pages)")
        j0 = 0
        for j in range(1, n + 1):  # a run ends where the device ids stop advancing by one, or with the piece
            if j == n or dev_pages[i + j] != dev_pages[i + j - 1] + 1:
                runs.append(PageRun(dev_pages[i + j0], chunk, first + j0, j - j0))
                j0 = j
        i += n
    return runs


def part_offsets(parts: Sequence[PagePart], chunk_pages: int) -> list[int]:
    """Byte offset of each part's region in a part-major chunk of chunk_pages pages."""
    out, at = [], 0
    for p in parts:
        out.append(at)
        at += chunk_pages * p.page_bytes
    return out


def plan_copies(runs: Sequence[PageRun], parts: Sequence[PagePart], chunk_pages: Mapping[int, int]) -> list[ByteCopy]:
    """The copies of runs for every part; chunk_pages: pages of each chunk (its part-major layout)."""
    out: list[ByteCopy] = []
    for r in runs:
        size = chunk_pages.get(r.chunk)
        if size is None:
            raise ValueError(f"host chunk {r.chunk} does not exist")
        if r.host_page + r.n > size:
            raise ValueError(f"host pages {r.host_page}..{r.host_page + r.n} outside chunk {r.chunk} of {size} pages")
        for j, (part, base) in enumerate(zip(parts, part_offsets(parts, size))):
            pb = part.page_bytes
            out.append(ByteCopy(j, r.dev_page * pb, r.chunk, base + r.host_page * pb, r.n * pb))
    return out


def plan_transfer(dev_pages: Sequence[int], host_pieces: Sequence[tuple[int, int, int]], parts: Sequence[PagePart],
                  chunk_pages: Mapping[int, int]) -> list[ByteCopy]:
    """page_runs then plan_copies: the byte copies between dev_pages and an allocation's host pieces."""
    return plan_copies(page_runs(dev_pages, host_pieces), parts, chunk_pages)
