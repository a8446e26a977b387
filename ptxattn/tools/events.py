"""CUDA event timing on one stream, shared by the benchmark and its sustained mode."""

from __future__ import annotations


class EventTimer:
    """CUDA events (ptxattn.driver.Event) recorded on one stream: by default the legacy default
    stream, which is also PyTorch's default stream, so timed work and events are ordered."""

    def __init__(self, stream=None):
        from .. import driver
        self._driver = driver
        self._stream = driver.stream_handle(stream)
        self._events: list = []

    def mark(self):
        event = self._driver.Event().record(self._stream)
        self._events.append(event)
        return event

    def elapsed_ms(self, start, end) -> float:
        return self._driver.elapsed_ms(start, end)

    def close(self):
        for event in self._events:
            event.close()
        self._events.clear()
