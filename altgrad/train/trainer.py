"""One training run: a nanoGPT on EUR-Lex under one format and layer-precision policy.

The loop knows nothing of Ray. Each step does one host sync: every metric of the step is a 0-dim
device tensor until a single `torch.stack(...).tolist()`. Non-finite steps are skipped on the
device (the optimizer's `found_inf`, as AMP's GradScaler does), so the weights never become NaN
and the host need not look before stepping.

Resume is exact: batches are a pure function of (seed, step), the LR schedule a pure function of
the step, and the checkpoint carries model (with scaler histories), optimizer, RNG and
stability-monitor state.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from altgrad.config import ConfigError, RunConfig, config_diff, deep_merge, dump_config
from altgrad.data import TokenBatches, prepare_dataset
from altgrad.experiment import EventKind, RunStatus, StopReason
from altgrad.metrics import (
    DIVERGENCE,
    FORMAT_SHIFTS,
    GRAD_HAS_NAN,
    GRAD_NORM,
    LOSS_IS_NAN,
    NAN_STREAK,
    STEP,
    TOKENS_PER_S,
    TRAIN_LOSS,
    TRAIN_LR,
    TRAIN_PPL,
    VAL_LOSS,
    VAL_PPL,
    VAL_STEP,
    is_checkpoint_step,
    is_diagnostic_step,
    is_eval_step,
    is_logged_step,
    is_shadow_step,
)
from altgrad.model import batch_loss
from altgrad.optim import build_optimizer
from altgrad.quant.convert import quantized_layers
from altgrad.quant.formats import get_format
from altgrad.quant.kernels import StepGraph, compile_status
from altgrad.quant.quantize import quantize
from altgrad.run_model import assigned_formats, build_model
from altgrad.train.bit_tracking import BitPositionsFile, BitTracker
from altgrad.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    resume_candidates,
)
from altgrad.train.cpu_allocator import retain_freed_memory
from altgrad.train.diagnostics import Diagnostics, Metrics, short_name
from altgrad.train.format_shift import layer_formats, restore_formats, shift_layers
from altgrad.train.nan_origin import NanOrigin
from altgrad.train.partition_clip import PartitionClipper
from altgrad.train.pre_step import StepStart, rng_state
from altgrad.train.run_files import RunFiles
from altgrad.train.schedule import lr_at
from altgrad.train.shadow import FP32Shadow
from altgrad.train.stability import Event, StabilityMonitor, stall_halts_learning

ReportFn = Callable[[dict[str, float], Path | None], None]
EventFn = Callable[[dict[str, Any]], None]  # an event as events.jsonl records it
CHECKPOINT_VERSION = 1


@dataclass(frozen=True)
class StepResult:
    """A step as the host reads it: its metrics, and the quantized layers a non-finite step was
    traced to (`NanOrigin`; empty for a finite step, or when it could not be localized)."""

    metrics: dict[str, float]
    nan_origin: list[str]


def to_host(named: Metrics, *tensors: torch.Tensor | None) -> tuple[dict[str, float], ...]:
    """The step's one host sync: every named metric (0-dim, or a block of them) and each further
    tensor (None stays None) copied to the host in a single `tolist`. Returns the metrics as floats
    by name, then each tensor's values as a flat list.

    Everything is concatenated into one float64 buffer, each part converted as it is copied (one
    op; each op is a dispatch, on a GPU a launch): integer counts stay exact, where float32 rounds
    those above 2^24 (a code-move histogram of GPT-2's 38.6M-weight tied head has them)."""
    names: list[str] = []
    parts: list[torch.Tensor] = []
    for key, value in named.items():
        names.extend(key if isinstance(key, tuple) else (key,))
        parts.append(value.reshape(-1))
    parts += [t.reshape(-1) for t in tensors if t is not None]
    values: list[float] = []
    if parts:
        with torch.no_grad():  # (`out=` takes no inputs that require grad)
            copy = torch.empty(sum(p.numel() for p in parts), dtype=torch.float64, device=parts[0].device)
            values = torch.cat(parts, out=copy).tolist()
    out: list[Any] = [dict(zip(names, values[:len(names)], strict=True))]
    at = len(names)
    for t in tensors:
        if t is None:
            out.append(None)
        else:
            out.append(values[at:at + t.numel()])
            at += t.numel()
    return tuple(out)


def resolve_device(name: str) -> torch.device:
    """`train.device` on this machine: "auto" is CUDA where there is a device; "cuda" without one
    is a user's error (ConfigError), not a failure deep inside the first batch."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda, but this machine has no CUDA device (use cpu or auto)")
    return torch.device(name)


def with_threads(cfg: RunConfig) -> RunConfig:
    """Compute with the run's `train.threads` (the process's count where it names none) and return
    the config that records it, for config.yaml. The count is the process's from then on: a run
    owns its process (a trial, the CLI), and benchmarks that build several trainers name none."""
    threads = cfg.train.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"threads": threads})})


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path | str):
        self._started = time.perf_counter()  # `first_step_s` counts from here
        self.first_step_s: float | None = None
        cfg = with_threads(cfg)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.device = resolve_device(cfg.train.device)
        if self.device.type == "cpu":
            retain_freed_memory()
        data_dir = prepare_dataset(cfg.data)  # DataError on a user problem, before anything is written
        t = cfg.train
        self.batches = TokenBatches(data_dir, cfg.model.block_size, t.batch_size, t.seed, device=self.device)
        self.val_batches = self.batches.val_batches(t.eval_iters)

        torch.manual_seed(t.seed)
        self.model = build_model(cfg).to(self.device)
        loss_of = partial(batch_loss, self.model)  # (x, y) -> loss
        self.forward = StepGraph(loss_of, t.cuda_graphs) if t.compile else loss_of
        self.optimizer = build_optimizer(cfg.optim.name, self.model, cfg.optim)
        self.params = list(self.model.parameters())  # walked every step: listed once
        if not getattr(self.optimizer, "_step_supports_amp_scaling", False):
            raise TypeError(f"optimizer {cfg.optim.name!r} must honour `found_inf` to skip NaN steps")
        self.layers = {short_name(n): m for n, m in quantized_layers(self.model).items()}
        k = cfg.optim.partition_clip_k
        self.clipper = PartitionClipper(self.layers, k, cfg.quant.scaling.history_len) if k and self.layers else None
        self.nan_origin = NanOrigin(self.layers, self.model)
        # the diagnostics' calls outside the step graph are replayed where the step graph is
        replay = isinstance(self.forward, StepGraph) and self.forward.replays_on(self.device)
        self.diagnostics = Diagnostics(self.model, get_format(cfg.quant.grad_format), replay,
                                       stored_in_format=cfg.quant.stores_weights_in_format)
        self.shadow = FP32Shadow(self.model.config, self.device) if t.shadow_every else None
        self.monitor = StabilityMonitor(cfg.stability, stall_shifts=stall_halts_learning(cfg))
        self.checkpoints = CheckpointManager(self.run_dir, t.keep_last)
        self.files = RunFiles(self.run_dir)
        self.bit_tracker = BitTracker(self.layers, seed=t.seed, replay=replay) if self.layers and t.diag_every else None
        self.bit_file = BitPositionsFile(self.files)
        self.step_start = StepStart({"model": self.model, **({"partition_clip": self.clipper} if self.clipper else {})})
        self.resumed_changes: list[str] = []  # `_load_state`: this config against the checkpoint's
        self.best_val = math.inf
        self.val_loss = math.nan
        self.val_step = 0
        self.wall_time = 0.0
        self.on_event: EventFn | None = None

    # -- public --------------------------------------------------------------------------
    def fit(self, report: ReportFn | None = None, resume: Path | str | None = None,
            on_event: EventFn | None = None) -> dict[str, Any]:
        """Train to `max_steps` or until the stability policy stops the run; returns the summary.
        `report` gets each logged step's metrics (and the checkpoint written at it), `on_event`
        each event as it is recorded."""
        self.on_event = on_event
        start, skipped = self._resume(Path(resume)) if resume is not None else (0, [])
        if start > self.cfg.train.max_steps:  # (checked before any file of the run is touched)
            raise ConfigError(f"the run's checkpoint is at step {start}, past train.max_steps="
                              f"{self.cfg.train.max_steps}: resume with max_steps >= {start}")
        self.files.start(dump_config(self.cfg), resume_step=start if resume is not None else None)
        for problem in skipped:
            self._log_event(start, Event(EventKind.CHECKPOINT_SKIPPED, problem))
        if resume is not None:
            changed = f" with changed settings: {'; '.join(self.resumed_changes)}" if self.resumed_changes else ""
            self._log_event(start, Event(EventKind.RESUME, f"resumed from step {start}{changed}",
                                         {"changed": self.resumed_changes} if changed else {}))
        max_steps = self.cfg.train.max_steps
        stop_reason = None
        trained = start  # the last step trained
        t_last = time.perf_counter()
        try:
            for step in range(start + 1, max_steps + 1):
                result = self.train_step(step)
                trained = step
                metrics = result.metrics
                now = time.perf_counter()
                if self.first_step_s is None:  # this process's first step: data, model, compiling
                    self.first_step_s = now - self._started
                self.wall_time += now - t_last
                metrics[TOKENS_PER_S] = self.cfg.train.batch_size * self.cfg.model.block_size / (now - t_last)
                t_last = now
                stop_reason = self._apply_policy(step, metrics, result.nan_origin)
                if is_logged_step(self.cfg.train, step) or stop_reason:
                    self.files.log_metrics(metrics)  # before the checkpoint: a checkpoint's rows exist
                ckpt = None
                if is_checkpoint_step(self.cfg.train, step):
                    ckpt = self.checkpoints.save(step, self._state(step), self.val_loss)
                    self.files.write_summary(self._summary(step, RunStatus.RUNNING, None))
                if report is not None and (is_logged_step(self.cfg.train, step) or stop_reason):
                    report(metrics, ckpt)
                if stop_reason:
                    break
        except (SystemExit, KeyboardInterrupt):
            # Ended from outside: Tune stops a trial inside `report` (its scheduler or stopper), or
            # Ctrl-C. The summary keeps what ran (the collapse, the wall time) for the records; a
            # stop the trainer itself decided at that step is its own (a crash writes nothing: the
            # last checkpoint's summary stands, and the error is Ray's or the traceback's to say).
            status = RunStatus.FINISHED if stop_reason else RunStatus.STOPPED
            self.files.write_summary(self._summary(trained, status, stop_reason))
            raise
        summary = self._summary(trained, RunStatus.FINISHED, stop_reason or StopReason.COMPLETED)
        self.files.write_summary(summary)
        return summary

    # -- one step -------------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        """One optimizer step (1-based): its metrics and, for a non-finite step, the layers it was
        traced to. `fit` adds the policy, files and checkpoints.

        The phases, in order: schedule; forward and backward; gradient clipping and the skip
        decision (made on the device); the optimizer step; diagnostics of the update; the one
        host sync of everything the step measured."""
        t = self.cfg.train
        # (what a skipped step changes, for the checkpoint of the state before it: `_apply_policy`)
        self.step_start.capture(self.optimizer, val=self._val_state(), wall_time_s=self.wall_time)
        x, y = self.batches.train_batch(step - 1)
        lr = lr_at(step - 1, self.cfg.optim.lr, t.warmup_steps, t.max_steps, self.cfg.optim.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        diag = is_diagnostic_step(t, step)
        shadow = is_shadow_step(t, step)
        evaluate = is_eval_step(t, step)

        # forward and backward; what the diagnostics read from them before the update
        if not self.model.training:  # (only `_evaluate` leaves train mode; setting it walks every module)
            self.model.train()
        if diag:
            self.diagnostics.begin()
        with self._autocast():
            loss = self.forward(x, y)
        loss.backward()
        m: Metrics = {}
        if diag:
            m.update(self.diagnostics.after_backward())
        if shadow:
            m.update(self.shadow.cosines(self.model, x, y))

        # clipping and the skip decision, on the device
        loss, grad_norm, nan_probe = self._clip_and_gate(loss)

        # the update
        self.optimizer.step()
        if self.cfg.quant.stores_weights_in_format:
            if diag:
                self.diagnostics.keep_update()  # which weights the update changed, before rounding
            self._requantize_weights()
        bits = None
        if diag:
            update, moves = self.diagnostics.after_update()  # the update, as the weights store it
            m.update(update)
            self.diagnostics.end()
        if diag and self.bit_tracker is not None:
            bits = self.bit_tracker.observe(moves)
        self.optimizer.zero_grad(set_to_none=True)

        m[TRAIN_LOSS] = loss
        m[GRAD_NORM] = grad_norm
        m[LOSS_IS_NAN] = (~torch.isfinite(loss)).float()
        m[GRAD_HAS_NAN] = (~torch.isfinite(grad_norm)).float()
        if evaluate:
            m[VAL_LOSS] = self._evaluate()

        # the one host sync
        values, probe, bit_values = to_host(m, nan_probe, bits)
        if bits is not None:
            self.bit_file.write(self.bit_tracker.rows(step, bit_values))
        metrics = {STEP: float(step), TRAIN_LR: lr, **values}
        metrics[TRAIN_PPL] = _ppl(metrics[TRAIN_LOSS])
        if evaluate:
            self.val_loss = metrics[VAL_LOSS] if math.isfinite(metrics[VAL_LOSS]) else math.inf
            self.val_step = step
            self.best_val = min(self.best_val, self.val_loss)
        metrics.update({VAL_LOSS: self.val_loss, VAL_PPL: _ppl(self.val_loss), VAL_STEP: float(self.val_step)})
        return StepResult(metrics, self.nan_origin.blame(int(probe[0])))

    def _clip_and_gate(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Clip the gradients and tell the optimizer to skip a non-finite step (`found_inf`, read
        on the device). Returns the detached loss, the gradient norm before clipping and the probe
        that locates a non-finite value (`NanOrigin.first_bad`)."""
        if self.clipper is not None:
            self.clipper.clip_()
        clip = self.cfg.optim.grad_clip or math.inf
        params = [p for p in self.params if p.grad is not None]
        norms = torch._foreach_norm([p.grad for p in params])  # per parameter: also locate NaNs
        grad_norm = torch.linalg.vector_norm(torch.stack(norms))  # what clip_grad_norm_ computes
        torch.nn.utils.clip_grads_with_norm_(params, clip, grad_norm, foreach=True)
        loss_ok, grad_ok = torch.isfinite(loss.detach()), torch.isfinite(grad_norm)
        self.optimizer.found_inf = (~(loss_ok & grad_ok)).float()  # the step is skipped on device
        return loss.detach(), grad_norm, self.nan_origin.first_bad(loss, dict(zip(params, norms, strict=True)))

    @torch.no_grad()
    def _requantize_weights(self) -> None:
        """`master_weights: format`: the stored weights are the format's values, so a stalled
        update is lost. A skipped step leaves them as they were (decided on the device): its
        forward may have moved the weight scale, and rounding at the new scale would change
        weights no update touched (and the anomaly checkpoint's, `StepStart`)."""
        rounding = self.cfg.quant.weight_rounding
        skipped = self.optimizer.found_inf > 0
        for layer in self.layers.values():
            w = layer.weight
            w.copy_(torch.where(skipped, w, quantize(w, layer.policy.weight, layer.weight_scale, rounding=rounding)))

    @torch.no_grad()
    def _evaluate(self) -> torch.Tensor:
        """Mean loss over the fixed validation set, the same tokens for every seed and format
        (`TokenBatches.val_windows`); batches are equal in size, so the mean of their means is the
        mean over tokens. The eager model: an evaluation every `eval_interval` steps would not repay
        compiling a graph of its own (bit-identical either way)."""
        self.model.eval()
        with self._autocast():
            losses = [batch_loss(self.model, x, y) for x, y in self.val_batches]
        self.model.train()
        return torch.stack(losses).mean()

    @property
    def autocast(self) -> bool:
        """Whether the unquantized compute runs in bf16 autocast (on CUDA), else in fp32."""
        return self.cfg.train.autocast and self.device.type == "cuda"

    def _autocast(self):
        if self.autocast:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- stability policy -----------------------------------------------------------------
    def _apply_policy(self, step: int, metrics: dict[str, float], origin: list[str]) -> str | None:
        anomaly = None
        if self.monitor.opens_nan_run(metrics):  # the first non-finite step after a finite one (an
            # emergency shift within the run does not open another): saved before the monitor and
            # a shift change what the step started from
            anomaly = self.checkpoints.save_anomaly(step, self.step_start.restore(self._state(step - 1)))
        events, stop = self.monitor.observe_step(step, metrics, self._shift, origin)
        if metrics[VAL_STEP] == step:
            events += self.monitor.observe_eval(metrics[VAL_LOSS])
        if anomaly is not None:
            events.append(Event(EventKind.ANOMALY_CHECKPOINT, f"pre-step state saved to {anomaly.name}",
                                {"path": str(anomaly)}))
        for e in events:
            self._log_event(step, e)
        metrics[NAN_STREAK] = float(self.monitor.nan_streak)
        metrics[DIVERGENCE] = float(self.monitor.diverging)
        metrics[FORMAT_SHIFTS] = float(self.monitor.format_shifts)
        return stop

    def _log_event(self, step: int, event: Event) -> None:
        logged = self.files.log_event(step, event.kind, event.message, **event.extra)
        if self.on_event is not None:
            self.on_event(logged)

    def _shift(self, names: list[str] | None, reason: str) -> list[Event]:
        return shift_layers(self.layers, list(self.layers) if names is None else names, reason)

    # -- checkpoint state -----------------------------------------------------------------
    def _state(self, step: int) -> dict[str, Any]:
        return {
            "version": CHECKPOINT_VERSION,
            "step": step,
            "model": self.model.state_dict(),
            "formats": layer_formats(self.layers),
            "optimizer": self.optimizer.state_dict(),
            "partition_clip": self.clipper.state_dict() if self.clipper is not None else {},
            "rng": rng_state(),
            "monitor": self.monitor.state_dict(),
            "val": self._val_state(),
            "wall_time_s": self.wall_time,
            "config": self.cfg.model_dump(mode="json"),
        }

    def _check_same_formats(self, trained: dict[str, Any]) -> None:
        """ConfigError where the checkpoint's run (its config's `quant`) quantized its layers in
        other formats than this config does: its layer formats, which keep its emergency shifts,
        would replace this config's, and the run's records would name formats it never trained.
        The precision is compared by the formats it assigns, not by how it is written."""
        now = self.cfg.quant
        if "format" in trained and trained["format"] != now.format:
            raise ConfigError(f"the run trained quant.format = {trained['format']!r}, not {now.format!r}: a run's "
                              "formats do not change on resume; resume with its own, or start a new run")
        if "precision" not in trained:
            return
        written = now.model_dump(mode="json")["precision"]
        try:
            then = RunConfig.model_validate(deep_merge(self.cfg.model_dump(mode="json"),
                                                       {"quant": {"precision": trained["precision"]}}))
            same = assigned_formats(then) == assigned_formats(self.cfg)
        except ValueError:  # (a precision this version cannot read: as written, then)
            same = trained["precision"] == written
        if not same:
            raise ConfigError(f"the run trained quant.precision = {trained['precision']!r}, not {written!r}: a run's "
                              "formats do not change on resume; resume with its own, or start a new run")

    def _val_state(self) -> dict[str, float]:
        return {"best": self.best_val, "last": self.val_loss, "step": self.val_step}

    def _resume(self, path: Path) -> tuple[int, list[str]]:
        """Restore from the newest usable checkpoint at `path`; a corrupt one falls back to older.

        Returns the step to continue from and a message per checkpoint that had to be skipped.
        """
        problems = []
        for candidate in resume_candidates(path):
            try:
                self._load_state(load_checkpoint(candidate))
            except CheckpointError as e:
                problems.append(str(e))
                continue
            return self.resumed_step, problems
        detail = "; ".join(problems) if problems else f"no checkpoint found under {path}"
        raise CheckpointError(f"cannot resume: {detail}")

    def _load_state(self, state: dict[str, Any]) -> None:
        self._check_same_formats(state.get("config", {}).get("quant", {}))
        # what this config changes from the checkpoint's (a longer max_steps stretches the lr
        # schedule, so the lr jumps): said in the resume event, the run's own record of it
        self.resumed_changes = config_diff(state["config"], self.cfg.model_dump(mode="json")) if "config" in state else []
        try:
            restore_formats(self.layers, state["formats"])  # a shifted format, before its scales
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.clipper is not None:
                self.clipper.load_state_dict(state["partition_clip"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint does not match this run's model/optimizer: {e}") from None
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.monitor.load_state_dict(state["monitor"])
        self.best_val, self.val_loss, self.val_step = (state["val"][k] for k in ("best", "last", "step"))
        self.wall_time = state["wall_time_s"]
        self.resumed_step = int(state["step"])

    def _compile_summary(self) -> str:
        """`compile_status`, saying what ran compiled: the whole step as one graph
        (`train.compile`) or each quantizer as its own kernel."""
        status = compile_status()
        if status != "compiled":
            return status
        return "compiled (step graph)" if self.cfg.train.compile else "compiled (per-tensor kernels)"

    def _summary(self, step: int, status: str, stop_reason: str | None) -> dict[str, Any]:
        q = self.cfg.quant
        return {
            "status": status,
            "stop_reason": stop_reason,
            "steps": step,
            "max_steps": self.cfg.train.max_steps,
            "best_val_loss": self.best_val,
            "final_val_loss": self.val_loss,
            "collapse_step": self.monitor.collapse_step,
            "collapse_where": self.monitor.collapse_where,
            "wall_time_s": round(self.wall_time, 3),
            "first_step_s": None if self.first_step_s is None else round(self.first_step_s, 3),
            "compile": self._compile_summary(),
            "autocast": self.autocast,
            "format": q.format,
            "optimizer": self.cfg.optim.name,
            "precision": q.precision if isinstance(q.precision, str) else "custom",
        }


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
