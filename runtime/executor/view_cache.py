"""Device tensor views made once and reused.

`Tensor._create_view` costs ~5 us of Python a call (more on a slow host core), and a speculative round made
dozens of the same views (its staging scatter, the draft chain's rows, state slots, replay buffers) while the
device waited for the next launch. Views are keyed by the base's address, dtype, shape and offset; a cached view
keeps its base alive, so no other allocation can take a cached address.
"""
from __future__ import annotations

from typing import Any


class ViewCache:
    def __init__(self, limit: int = 1024):
        self.limit = limit
        self._views: dict[tuple, Any] = {}

    def __call__(self, base, shape: tuple, dtype: str, byte_offset: int = 0):
        """base._create_view(shape, dtype, byte_offset), the same object whenever it recurs."""
        key = (base.data_ptr(), dtype, shape, byte_offset)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= self.limit:
                self._views.clear()
            view = self._views[key] = base._create_view(tuple(int(x) for x in shape), dtype, byte_offset)
        return view
