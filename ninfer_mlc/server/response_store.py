"""Stored Responses API responses (``store: true``): what ``previous_response_id``, GET, DELETE and
``input_items`` read. In memory and bounded (entries and bytes), oldest first out, so a client
that stores every turn cannot grow the server without limit; a dropped id answers "not found"
as an expired one does on the real API."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass
class StoredResponse:
    response: dict  # the response object as answered
    input_items: list[dict]  # this request's input items (with ids), for GET .../input_items
    history: list[dict]  # every item of the conversation up to and including this response's output
    size: int = 0


class ResponseStore:
    def __init__(self, max_entries: int = 512, max_bytes: int = 256 << 20):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one response")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: "OrderedDict[str, StoredResponse]" = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, input_items: list[dict], history: list[dict]) -> None:
        entry = StoredResponse(response, input_items, history)
        # history shares its items with earlier entries, so this overcounts: a safe bound
        entry.size = len(json.dumps([response, input_items, history], ensure_ascii=False, default=str))
        with self._lock:
            old = self._items.pop(response["id"], None)
            if old is not None:
                self.bytes -= old.size
            self._items[response["id"]] = entry
            self.bytes += entry.size
            while self._items and (len(self._items) > self.max_entries or self.bytes > self.max_bytes):
                _, dropped = self._items.popitem(last=False)
                self.bytes -= dropped.size

    def get(self, rid: str) -> Optional[StoredResponse]:
        with self._lock:
            return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        with self._lock:
            entry = self._items.pop(rid, None)
            if entry is not None:
                self.bytes -= entry.size
            return entry is not None
