"""Prefix cache: whole KV pages shared by every request whose sequence starts the same.

A full page is indexed by ``(parent page, its tokens)``, so a page id stands for the
whole prefix that ends with it and a lookup walks a request's pages from the first:
a radix tree whose edges are one page long. Requests hold pages by reference count;
an indexed page nobody holds stays cached, in least-recently-used order, and is
evicted only when an allocation needs its room.

Eviction order keeps the tree sound without walking it: a request always holds a
whole path from the first page, and releases it leaf first, so a parent is always
more recent than its children and the oldest unheld page is a leaf. Eviction still
checks that a page has no cached children, so that no index entry can outlive its
parent's page id (which would let a reused page id match stale KV).

Everything here runs on the loop thread with the batch core; it never touches the
KV tensors, only which pages hold what.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .allocator import PageAllocator

ROOT = -1
Key = tuple[int, tuple[int, ...]]


class PrefixCache:
    """Page accounting for the batch core: allocation (evicting cached pages when short),
    release, and, when ``enabled``, lookup and insertion of whole-page prefixes.

    Disabled, it is a thin layer over the allocator with the same interface, so the
    batch core has one code path.
    """

    def __init__(self, allocator: PageAllocator, *, enabled: bool = True) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.enabled = enabled
        # Per page id (the allocator's ids are 0 .. num_pages-1), lists rather than dicts:
        # every page of every prompt and finished request passes through ``insert`` and
        # ``release``, and a list index costs a fraction of a dict's hash and probe.
        self._page_of: dict[Key, int] = {}
        self._key_of: list[Key | None] = [None] * allocator.num_pages  # an indexed page's key
        self._children: list[int] = [0] * allocator.num_pages  # indexed page -> indexed children
        self._refs: list[int] = [0] * allocator.num_pages  # shared pages (indexed, or indexed once) -> holders; 0: none
        self._cached = 0  # indexed pages
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Grows on every invalidation: a request indexes its pages only in the epoch
        # it was admitted in, since KV computed before new weights must not be shared.
        self.epoch = 0
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0

    # ------------------------------------------------------------------ accounting

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get: free ones plus cached ones nobody holds."""
        return self.allocator.free_pages + len(self._evictable)

    @property
    def cached_pages(self) -> int:
        return self._cached

    @property
    def held_pages(self) -> int:
        """Pages some request holds (the KV that is not just cache)."""
        return self.allocator.used_pages - len(self._evictable)

    def count_lookup(self, tokens: int, hit_tokens: int, times: int = 1) -> None:
        """Hit-rate bookkeeping of an admitted lookup (``times=-1`` takes one back)."""
        self.lookup_tokens += times * tokens
        self.hit_tokens += times * hit_tokens

    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def stats(self) -> dict[str, float | int | bool]:
        return {
            "prefix_cache_enabled": self.enabled,
            "prefix_cache_pages": self.cached_pages,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_lookup_tokens": self.lookup_tokens,
            "prefix_cache_hit_rate": round(self.hit_rate(), 4),
            "prefix_cache_evicted_pages": self.evicted_pages,
        }

    # ------------------------------------------------------------------ pages

    def allocate(self, num_pages: int) -> list[int]:
        """Fresh pages, private to the caller; evicts cached pages when free ones are short."""
        short = num_pages - self.allocator.free_pages
        if short > 0:
            self._evict(short)
        return self.allocator.allocate(num_pages)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one hold on each page, leaf first. A private page is freed; a shared one
        is freed or kept cached when its last holder lets go. The freed pages go back in
        one call (in the same order as one by one): a finished request of NV256's shape
        releases ~70 pages, and this runs for every request that ends."""
        refs, key_of, evictable = self._refs, self._key_of, self._evictable
        freed: list[int] = []
        for page in reversed(pages):
            count = refs[page]
            if not count:
                freed.append(page)
            elif count > 1:
                refs[page] = count - 1
            else:
                refs[page] = 0
                if key_of[page] is not None:
                    evictable[page] = None
                else:
                    freed.append(page)
        if freed:
            self.allocator.free(freed)

    # ------------------------------------------------------------------ prefixes

    def match(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Hold and return the cached pages of the longest whole-page prefix of
        ``tokens`` no longer than ``max_tokens``."""
        if not self.enabled:
            return []
        ps = self.page_size
        limit = max(0, max_tokens) // ps
        pages: list[int] = []
        parent = ROOT
        page_of = self._page_of
        for i in range(limit):
            page = page_of.get((parent, tuple(tokens[i * ps : (i + 1) * ps])))
            if page is None:
                break
            pages.append(page)
            parent = page
        for page in pages:
            self._hold(page)
        return pages

    def first_unmatched_key(self, tokens: Sequence[int], pages: Sequence[int]) -> Key | None:
        """The index key the page after ``pages`` would get (None when ``tokens`` has no
        further full page): two requests with the same one would compute the same page."""
        ps = self.page_size
        i = len(pages)
        if not self.enabled or (i + 1) * ps > len(tokens):
            return None
        return (pages[-1] if pages else ROOT, tuple(tokens[i * ps : (i + 1) * ps]))

    def insert(self, tokens: Sequence[int], pages: Sequence[int], start_page: int, num_tokens: int) -> int:
        """Index the request's full pages ``start_page..`` whose KV covers the first
        ``num_tokens`` of ``tokens``; returns how many leading pages are indexed now.

        A page whose prefix another page already holds stays private, and so does every
        page after it (their parent is not the indexed one): the count stops there."""
        if not self.enabled:
            return start_page
        ps = self.page_size
        end = min(num_tokens, len(tokens)) // ps
        i = start_page
        parent = pages[i - 1] if i else ROOT
        if i >= end or (parent != ROOT and self._key_of[parent] is None):
            return i
        # Runs for every page of every prompt (and of every finished output), so the key
        # (a tuple of page_size ids, whose hash is not cached) is hashed once: a page is
        # new to the index when ``setdefault`` stored it and it had no key of its own.
        # Each page indexed here is indexed when the loop moves on, so only the first
        # parent needs the check above.
        page_of, key_of, children, refs = self._page_of, self._key_of, self._children, self._refs
        at, new = i * ps, 0
        while i < end:
            key = (parent, tuple(tokens[at : at + ps]))
            page = pages[i]
            owner = page_of.setdefault(key, page)
            if owner != page:
                break  # computed twice: this copy stays private
            if key_of[page] is None:
                key_of[page] = key
                new += 1
                children[page] = 0
                if parent != ROOT:
                    children[parent] += 1
                if not refs[page]:
                    refs[page] = 1  # the caller's hold; a page already shared keeps its count
            parent = page
            i += 1
            at += ps
        self._cached += new
        return i

    def invalidate(self) -> None:
        """Forget every cached prefix (new weights, a failed step). Unheld cached pages
        are freed; held ones stay with their holders and are freed by their release."""
        self.epoch += 1
        if self._evictable:
            self.allocator.free(list(self._evictable))
        self._evictable.clear()
        self._page_of.clear()
        n = self.allocator.num_pages
        self._key_of, self._children, self._cached = [None] * n, [0] * n, 0

    def flush(self) -> bool:
        """Empty the cache; refused (False) while any request holds KV."""
        if self.held_pages:
            return False
        self.invalidate()
        return self.allocator.is_fully_free()

    # ------------------------------------------------------------------ internals

    def _hold(self, page: int) -> None:
        count = self._refs[page]
        if count == 0:
            self._evictable.pop(page, None)
        self._refs[page] = count + 1

    def _evict(self, num_pages: int) -> None:
        """Free ``num_pages`` cached pages nobody holds, least recently used first. Once
        the KV is full of finished requests' prefixes this runs for every page a prompt
        or a decode step takes, so the oldest page (a leaf, see the module's docstring)
        is taken without a scan; the scan for a leaf is the fallback."""
        evictable, children, key_of, page_of = self._evictable, self._children, self._key_of, self._page_of
        victims: list[int] = []
        while len(victims) < num_pages and evictable:
            victim = next(iter(evictable))
            if children[victim]:
                victim = next((p for p in evictable if not children[p]), None)
                if victim is None:
                    break
            del evictable[victim]
            key = key_of[victim]
            assert key is not None  # (only indexed pages are evictable)
            key_of[victim] = None
            del page_of[key]
            children[victim] = 0
            parent = key[0]
            if parent != ROOT and key_of[parent] is not None:
                children[parent] -= 1
            victims.append(victim)
        if victims:
            self.allocator.free(victims)  # in eviction order, in one call
        self._cached -= len(victims)
        self.evicted_pages += len(victims)
