"""The dispatcher from a feed's key to the captured graph that serves it: the buckets' and the drop-in's one map.

A plain ``run()`` that ortcapture serves from a captured graph (a bucket of ``InferenceSession(buckets=...)``, a shape
of the drop-in's :class:`~ortcapture._session.dropin.AutoCaptureSession`) first computes its feeds' key (shapes,
dtypes, host-read values: the caller's to define), then asks a :class:`GraphDispatcher` which graph serves it. As in
vLLM's CUDA-graph dispatcher, this is the only source of truth for that: one map per session, holding

* live entries (whatever the caller keeps per graph: the graph itself, or the bucket runner's entry around it),
  in least-recently-used order;
* refused keys (:class:`Refused`, the error that refused them): the same request is not captured again;
* at most ``max_graphs`` graphs: beyond it either the least recently used live entry is evicted (``full="evict"``,
  buckets; the caller releases its graph) or new keys are not admitted (``full="refuse"``, the drop-in, whose
  refused keys count too).

Thread-safe: every method takes :attr:`GraphDispatcher.lock` (reentrant); a caller that looks a key up and then
captures for it holds the lock across both, so one thread captures a key while the others wait for its entry.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable, Iterator

FULL = ("evict", "refuse")


class Refused:
    """A refused key's entry: ``error`` is why its graph could not be captured (or verified)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class GraphDispatcher:
    """``key -> entry`` for one session's graphs (see the module docstring).

    Args:
        max_graphs: live entries at most (``None``: no limit).
        full: ``"evict"`` (make room by evicting the least recently used live entry) or ``"refuse"`` (admit no new
            key once ``max_graphs`` keys, refused ones included, are known).
        lock: the lock to share (a reentrant one); by default its own ``threading.RLock``.
    """

    def __init__(self, max_graphs: int | None = None, *, full: str = "evict", lock=None):
        if full not in FULL:
            raise ValueError(f"full must be one of {FULL}, got {full!r}")
        self.max_graphs = max_graphs
        self.full = full
        #: held by every method; hold it across a look-up and the capture that follows it
        self.lock = lock if lock is not None else threading.RLock()
        self._entries: OrderedDict = OrderedDict()

    def get(self, key: Hashable) -> Any:
        """The entry of ``key`` — a live entry or a :class:`Refused` — now the most recently used; ``None`` for a key
        not known."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def peek(self, key: Hashable) -> Any:
        """:meth:`get` without the lock and without making the entry the most recently used (one dict read, atomic
        under the GIL): for a caller whose order does not matter (no ``max_graphs``) on its hot path."""
        return self._entries.get(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def add(self, key: Hashable, entry: Any) -> None:
        """Remember ``entry`` (live) for ``key``, as the most recently used."""
        with self.lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)

    def discard(self, key: Hashable, entry: Any) -> None:
        """Forget ``key`` if its entry is still ``entry`` (a graph released from outside: captured again on next
        use); nothing otherwise."""
        with self.lock:
            if self._entries.get(key) is entry:
                del self._entries[key]

    def prune(self, dead) -> list:
        """Forget every live entry for which ``dead(entry)`` is true (graphs released from outside, which would
        otherwise hold a place under ``max_graphs`` until their own key comes again); returns them."""
        with self.lock:
            gone = [k for k, e in self._entries.items() if not isinstance(e, Refused) and dead(e)]
            return [self._entries.pop(k) for k in gone]

    def forget_refused(self) -> None:
        """Forget every refused key (the session they were refused for is gone: ``set_providers``)."""
        with self.lock:
            for k in [k for k, e in self._entries.items() if isinstance(e, Refused)]:
                del self._entries[k]

    def refuse(self, key: Hashable, error: BaseException) -> Refused:
        """Remember that ``key`` was refused, with ``error``; returns its :class:`Refused` entry."""
        refused = Refused(error)
        with self.lock:
            self._entries[key] = refused
        return refused

    def admits(self) -> bool:
        """``full="refuse"``: whether a new key may still be captured (fewer than ``max_graphs`` keys known)."""
        with self.lock:
            return self.max_graphs is None or len(self._entries) < self.max_graphs

    def make_room(self) -> list:
        """``full="evict"``: before a new live entry, the least recently used live entries removed until it fits
        under ``max_graphs`` (oldest first; the caller releases their graphs); ``[]`` when it fits already."""
        out = []
        with self.lock:
            if self.max_graphs is None:
                return out
            while self.live() >= self.max_graphs:
                key = next((k for k, e in self._entries.items() if not isinstance(e, Refused)), None)
                if key is None:
                    break
                out.append(self._entries.pop(key))
        return out

    def live(self) -> int:
        """The live entries (refused keys not counted)."""
        with self.lock:
            return sum(1 for e in self._entries.values() if not isinstance(e, Refused))

    def entries(self) -> list:
        """The live entries, least recently used first."""
        with self.lock:
            return [e for e in self._entries.values() if not isinstance(e, Refused)]

    def refused(self) -> int:
        """The refused keys."""
        with self.lock:
            return sum(1 for e in self._entries.values() if isinstance(e, Refused))

    def refusals(self) -> list[BaseException]:
        """Why each refused key was refused: the errors, in the order the keys were last used."""
        with self.lock:
            return [e.error for e in self._entries.values() if isinstance(e, Refused)]

    def __iter__(self) -> Iterator:
        return iter(self.entries())

    def __len__(self) -> int:
        return len(self._entries)
