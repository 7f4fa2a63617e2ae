"""The driver's heartbeat in `sweep.json`: how a driver on another machine is told from a dead one.

A sweep on a cluster is driven from its head node; when that node is lost, the sweep is resumed
from shared storage by a driver on a new head. A pid can only be checked on its own host, so the
driver refreshes `driver.beat` (a Unix time) every `BEAT_S` seconds, and readers on other hosts
(`experiment.driver_alive`) count it as gone once the beat is `STALE_S` old.
"""

from __future__ import annotations

import time

from ray.tune import Callback

from altgrad.experiment import BEAT_S, SWEEP_FILE
from altgrad.tune.store import StateStore


class DriverHeartbeat(Callback):
    def __init__(self, store: StateStore, period_s: float = BEAT_S):
        self._store = store
        self.period_s = period_s
        self._last = 0.0

    def on_step(self, iteration: int, trials: list, **info) -> None:
        now = time.time()
        if now - self._last < self.period_s:
            return
        sweep = self._store.read(SWEEP_FILE)
        if sweep is not None and "driver" in sweep:
            sweep["driver"]["beat"] = now
            self._store.write(SWEEP_FILE, sweep)
        self._last = now
