"""Page allocator: hands out fixed-size KV pages and takes them back exactly once.

A double free or a free of a page that was never handed out raises immediately,
because either one means two requests could end up sharing KV.
"""

from __future__ import annotations

from ..errors import KVAllocationError


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: low page ids are handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._in_use: set[int] = set()

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return len(self._in_use)

    def is_fully_free(self) -> bool:
        return not self._in_use and len(self._free) == self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise KVAllocationError(f"asked for {num_pages} pages, {len(self._free)} free")
        free = self._free
        pages = free[len(free) - num_pages :][::-1]  # popped from the end, last first: in C rather than a pop a page
        del free[len(free) - num_pages :]
        self._in_use.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Take ``pages`` back, appended in order (the next allocation pops the last).
        Checked as a set, so a request's pages go back in a few C calls rather than a
        Python step per page; a double free (within ``pages`` too) or a page never handed
        out raises before any page is taken back."""
        taken = set(pages)
        if len(taken) != len(pages) or not taken <= self._in_use:
            raise KVAllocationError(self._bad_free(pages))
        self._in_use -= taken
        self._free.extend(pages)

    def _bad_free(self, pages: list[int]) -> str:
        seen: set[int] = set()
        for page in pages:
            if page not in self._in_use:
                return f"page {page} freed but not in use (double free?)"
            if page in seen:
                return f"page {page} freed twice in one call (double free?)"
            seen.add(page)
        return "bad free"

    def reset(self) -> None:
        """Forget every allocation (used after a cache flush, when no request holds KV)."""
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._in_use.clear()
