"""Progress bars for `ninfer compile` (tqdm): on a terminal by default, silent elsewhere (logs keep
the plain one-line summaries compile_model prints)."""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


class Progress:
    """`iterate` wraps a counted loop in a bar; `step` shows a ticking elapsed time for a long step
    with nothing to count (the TVM build)."""

    def __init__(self, enabled: Optional[bool] = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def iterate(self, items: Iterable[T], desc: str, total: Optional[int] = None, unit: str = "it") -> Iterable[T]:
        if not self.enabled:
            return items
        from tqdm import tqdm

        return tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True)

    @contextmanager
    def step(self, desc: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        from tqdm import tqdm

        bar = tqdm(total=1, desc=desc, bar_format="{desc}: {elapsed}", file=sys.stderr)
        done = threading.Event()

        def tick() -> None:
            while not done.wait(1.0):
                bar.refresh()

        ticker = threading.Thread(target=tick, name="compile-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
            bar.update(1)
            bar.close()


SILENT = Progress(enabled=False)
