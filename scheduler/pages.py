"""The coordinator's KV page pool: it owns every page id; workers only follow page tables.

Usable page ids are ``0..kv_pages-1`` (id ``kv_pages`` is every rank's padding page and is never
handed out). A request reserves all the pages it can ever need at admission, so nothing is
evicted mid-flight and a full pool makes new requests wait instead of failing running ones. A page
a request filled with a full prompt block may be handed over to the prefix cache
(scheduler.prefix_cache), which gives it back when it evicts the block.
"""

from __future__ import annotations


def pages_for_tokens(tokens: int, page_size: int) -> int:
    """How many pages hold ``tokens`` cached positions."""
    return -(-tokens // page_size)


class PagePool:
    def __init__(self, total: int, page_size: int) -> None:
        if total < 1 or page_size < 1:
            raise ValueError(
                f"a page pool needs at least one page of at least one token, got {total} x {page_size}"
            )
        self.total = total
        self.page_size = page_size
        # Pop from the end: low ids are handed out first, which keeps traces easy to read.
        self._free: list[int] = list(range(total - 1, -1, -1))
        self._owned: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._owned)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(
                f"page pool cannot allocate {count} pages: only {len(self._free)} of {self.total} free"
            )
        pages = [self._free.pop() for _ in range(count)]
        self._owned.update(pages)
        return pages

    def release(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._owned:
                raise RuntimeError(f"page {page} released but not allocated")
            self._owned.remove(page)
        self._free.extend(reversed(pages))

    def hand_over(self, pages: list[int]) -> None:
        """Requests' pages the prefix cache now owns: neither used by a request nor free."""
        for page in pages:
            if page not in self._owned:
                raise RuntimeError(f"page {page} handed over to the prefix cache but not allocated")
            self._owned.remove(page)

    def give_back(self, pages: list[int]) -> None:
        """Pages the prefix cache evicted: free again."""
        self._free.extend(reversed(pages))

    @property
    def free_pages(self) -> list[int]:
        return list(self._free)
