"""W&B: one run per trial, logged from the driver through Ray's callback; offline by default.

Ray's `WandbLoggerCallback` closes a trial's run only when the trial ends. After Ctrl-C (or
SIGTERM) the interrupted trials never end, and at experiment end Ray waits up to `upload_timeout`
for their runs; this subclass closes them first, so an interrupted sweep exits at once and every
W&B run is finished cleanly (a resumed trial logs to a new run of the same id).
"""

from __future__ import annotations

from pathlib import Path

from ray.air.integrations.wandb import WandbLoggerCallback

UPLOAD_TIMEOUT_S = 120  # online mode: time for the last uploads at the end of a sweep


class WandbPerTrial(WandbLoggerCallback):
    def on_experiment_end(self, trials: list, **info) -> None:
        for trial in list(self._trial_queues):  # Ray's own bookkeeping of the open runs
            self._signal_logging_actor_stop(trial)
        super().on_experiment_end(trials, **info)


def wandb_callback(project: str, mode: str, group: str, directory: Path) -> WandbPerTrial:
    import wandb

    return WandbPerTrial(project=project, group=group, mode=mode, dir=str(directory),
                         upload_timeout=UPLOAD_TIMEOUT_S, settings=wandb.Settings(silent=True))
