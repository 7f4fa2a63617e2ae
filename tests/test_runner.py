"""The sweep driver's signal handling (`altgrad.tune.runner`)."""

from __future__ import annotations

import signal

from altgrad.tune.runner import sigterm_stops_gracefully


def test_sigterm_takes_the_sigint_path():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda *a: seen.append("sigint"))
    try:
        with sigterm_stops_gracefully() as received:
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert received == [signal.SIGTERM] and seen == ["sigint"]
