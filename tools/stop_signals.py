"""SIGTERM as an exception, so that ``serve`` and ``generate`` stop their replica in order
(Shutdown to every rank) when a service manager or ``kill`` stops them, as they do on Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class StopSignal(BaseException):
    """SIGTERM arrived. A BaseException, as KeyboardInterrupt is: no ``except Exception`` on the
    way takes it for a failure of the code it interrupted. The server sees it once uvicorn has
    drained its connections (uvicorn re-sends the signal it stopped on); generate sees it at once."""


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While inside, SIGTERM raises ``StopSignal`` instead of ending the process at once."""

    def raise_stop(signum: int, _frame: object) -> None:
        raise StopSignal(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, raise_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
