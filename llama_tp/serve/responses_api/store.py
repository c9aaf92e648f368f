"""The responses a server keeps for its lifetime, for previous_response_id and GET
/v1/responses/{id}: at most --max_stored_responses of them, the oldest evicted first."""

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Stored:
    response: dict  # the Response object as it was answered
    conversation: tuple[dict, ...]  # its chat messages, input and answer, instructions left out: what follows it


class ResponseStore:
    """Stored responses by id; safe to use from the HTTP side's threads and event loop at once."""

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"max_stored_responses must be a whole number, 0 or more, found {capacity!r}")
        self.capacity = capacity
        self._kept: "OrderedDict[str, Stored]" = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: Stored) -> None:
        with self._lock:
            self._kept[response_id] = stored
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)  # the oldest first

    def get(self, response_id: str) -> Optional[Stored]:
        with self._lock:
            return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._kept.pop(response_id, None) is not None
