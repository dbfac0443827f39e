"""Write notifications, without importing SQLAlchemy: the dispatcher drops its memo when this
process writes the tuned DB (a search, `flashtune db import`)."""
from __future__ import annotations

_listeners: list = []


def on_write(callback) -> None:
    """Call `callback()` after each write through any TunedDB of this process."""
    if callback not in _listeners:
        _listeners.append(callback)


def notify_write() -> None:
    for cb in list(_listeners):
        cb()
