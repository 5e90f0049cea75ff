"""Holding back Ctrl-C (a notebook's "interrupt kernel") over sections that must run entirely or not at all.

    with defer_sigint():          # a SIGINT arriving inside is held back ...
        for mb in micro_batches:
            raise_if_interrupted()  # ... and raised here, at a point where stopping is safe
            forward_backward(mb)
        optimizer.step()          # (no check inside the update: it runs to its end)
    # ... or raised as KeyboardInterrupt right after the block

Nested blocks share the outermost one's hold. Only the main thread receives SIGINT (Python's rule), so in other
threads, or where a handler cannot be installed, the block runs unprotected. docs/reliability.md lists where
rlbench uses it and what "interrupt, then step() again" does at each point.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_held: list[list] = []  # one entry per open (outermost-installed) block: the signals it is holding


@contextlib.contextmanager
def defer_sigint() -> Iterator[None]:
    """Hold back SIGINT inside the block; a held signal is raised (the previous handler's way) on exit."""
    if _held or threading.current_thread() is not threading.main_thread():
        yield  # nested: the outer block holds; other threads never get SIGINT
        return
    previous = signal.getsignal(signal.SIGINT)
    received: list = []
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: received.append((signum, frame)))
    except ValueError:  # not allowed here: run unprotected
        yield
        return
    _held.append(received)
    try:
        yield
    finally:
        _held.pop()
        signal.signal(signal.SIGINT, previous)
        if received:
            _deliver(previous, received[0])


def raise_if_interrupted() -> None:
    """Inside `defer_sigint`: raise the held Ctrl-C now (a safe point); elsewhere nothing."""
    if _held and _held[-1]:
        del _held[-1][:]
        raise KeyboardInterrupt


def _deliver(handler, args) -> None:
    if callable(handler):
        handler(*args)
    elif handler != signal.SIG_IGN:
        raise KeyboardInterrupt
