"""Prefetching (Caffe's prefetching data layers): :func:`prefetch` runs an iterator in a
background thread; :func:`stop_prefetchers` stops them (``cct`` calls it when a command ends, and
it runs at interpreter exit)."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from typing import Iterator, Optional

from keras_cct.errors import DataError

__all__ = ["prefetch", "stop_prefetchers", "running_prefetchers"]


_PREFETCHERS = None  # a weakref.WeakSet of the running prefetchers, made on first use


def running_prefetchers() -> list:
    """The :func:`prefetch` iterators whose thread is running now."""
    return [it for it in list(_PREFETCHERS or ()) if not it.join(0)]


def stop_prefetchers(timeout: float = 2.0, *, keep=()) -> None:
    """Stop every running :func:`prefetch` thread (but those in ``keep``) and wait (up to
    ``timeout`` seconds in all) for them to end. ``cct`` calls it for the prefetchers a command
    started when it ends, and it runs at interpreter exit: a reader thread left running would
    be frozen holding its library's lock (h5py's global lock, LMDB's), and the interpreter's
    shutdown would wait for that lock forever."""
    kept = {id(it) for it in keep}
    its = [it for it in running_prefetchers() if id(it) not in kept]
    if not its:
        return
    for it in its:
        it.close()
    end = time.monotonic() + timeout
    for it in its:
        it.join(max(end - time.monotonic(), 0.0))


def prefetch(iterator: Iterator, depth: int = 4) -> Iterator:
    """Run ``iterator`` in a background thread, ``depth`` items ahead (Caffe's prefetching
    data layers); exceptions are re-raised in the consumer. ``close()`` stops the thread
    (after the item it is reading); :func:`stop_prefetchers` stops them all."""
    global _PREFETCHERS
    if _PREFETCHERS is None:
        _PREFETCHERS = weakref.WeakSet()
        atexit.register(stop_prefetchers)
    q: "queue.Queue" = queue.Queue(maxsize=max(depth, 1))
    stop = threading.Event()
    _END = object()

    def put(entry) -> bool:
        """Queue ``entry`` unless stopped first; whether it was queued."""
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in iterator:
                if not put((item, None)):
                    return
        except BaseException as exc:  # forwarded to the consumer
            put((_END, exc))
            return
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                try:
                    close()  # a generator's files (h5py, LMDB) are closed in this thread
                except Exception:
                    pass
        put((_END, None))

    thread = threading.Thread(target=work, daemon=True, name="cct-prefetch")
    thread.start()

    class _It:
        def __iter__(self):
            return self

        def __next__(self):
            while True:
                try:
                    item, exc = q.get(timeout=0.5)
                    break
                except queue.Empty:
                    if not thread.is_alive() and q.empty():
                        raise DataError("the data reader thread was stopped (its prefetch "
                                        "iterator was closed)") from None
            if item is _END:
                if exc is not None:
                    raise exc
                raise StopIteration
            return item

        def close(self):
            stop.set()

        def join(self, timeout: Optional[float] = None) -> bool:
            """Wait for the thread to end; whether it did."""
            thread.join(timeout)
            return not thread.is_alive()

        def __del__(self):
            stop.set()

    it = _It()
    _PREFETCHERS.add(it)
    return it
