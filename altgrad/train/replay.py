"""Calls recorded once as a CUDA graph and replayed: the diagnostics' work outside the step graph.

A diagnostic step's calls after the backward and after the update (gradient statistics, the
snapshot, code moves, quantizer metrics, bit tracking) launch dozens of kernels, and on a GPU the
host's time to launch them, not the kernels, is what they cost (docs/design.md, "GPU runs"). The
tensors they read -- weights, scales and counters, the snapshot, and the gradients and kurtosis
values that the replayed step graph returns -- stay at the same addresses from step to step, so
their launches can be recorded once and replayed, like the step graph's own.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

# Recordings one call keeps (each holds its own memory pool): the diagnostics see one set of
# tensors per step graph (diagnostics on and off, formats after a shift), a handful in a run.
MAX_GRAPHS = 8


def identity(values: Iterable[Any]) -> tuple[Hashable, ...]:
    """What must not change for a recording to stand in for a call, item by item: a tensor's
    address, shape, strides and dtype (where it is, not what it holds; None where there is none),
    and anything else as itself (a name, a layer's policy: it must be hashable). Flat, and cheap
    to take: it is taken at every call, on the host time the replay saves."""
    return tuple((v.data_ptr(), v.shape, v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v for v in values)


class ReplayedCall:
    """`fn(*args)` on CUDA, recorded as a CUDA graph and replayed while the tensors it reads stay put.

    `reads(*args)` lists everything `fn(*args)` reads -- its tensors, and whatever decides which
    kernels it launches (formats, which gradients exist) -- and `fn` must depend on nothing else:
    a replay reads the recorded addresses and runs none of `fn`'s Python. A call whose `identity`
    of `reads(*args)` matches a recording replays it; the first call with a new identity runs
    `fn` as it is (compiling its kernels, filling the caches it reads), and a second in a row with
    the same identity records it. A recording launches nothing, so it is replayed at once. A
    replay returns what the recording returned, the same objects every time (containers too),
    whose tensors every replay overwrites: the caller must neither change them nor keep them past
    the next call.

    What `fn` may not do, recorded: read a value back to the host (a sync), copy from the host,
    compile, or draw random numbers. A recording that fails is dropped with a warning, and this
    call runs `fn` eagerly from then on (`error` says why): none of the kernels `fn` launched while
    it was recorded ran. So does a call past `MAX_GRAPHS` recordings, whose tensors keep moving.
    """

    def __init__(self, fn: Callable[..., Any], reads: Callable[..., Iterable[Any]], max_graphs: int = MAX_GRAPHS):
        self.fn = fn
        self.reads = reads
        self.max_graphs = max_graphs
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.replays = 0
        self.error: str | None = None
        self._last: Hashable | None = None  # the identity of the last call that ran `fn` as it is

    def __call__(self, *args: Any) -> Any:
        if self.error is not None:
            return self.fn(*args)
        key = identity(self.reads(*args))
        recorded = self.graphs.get(key)
        if recorded is None:
            if key != self._last or len(self.graphs) >= self.max_graphs:
                self._last = key
                return self.fn(*args)
            recorded = self._record(args)
            if recorded is None:
                return self.fn(*args)
            self.graphs[key] = recorded
        graph, out = recorded
        graph.replay()
        self.replays += 1
        return out

    def _record(self, args: tuple[Any, ...]) -> tuple[torch.cuda.CUDAGraph, Any] | None:
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls of the process's other threads (a library's) are theirs,
            # not an error of the recording
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self.fn(*args)
        except Exception as err:  # noqa: BLE001 - whatever the recording met, the call runs eagerly
            self.error = f"{type(err).__name__}: {err}".splitlines()[0]
            warnings.warn(f"altgrad: {getattr(self.fn, '__qualname__', self.fn)} could not be recorded as a CUDA "
                          f"graph ({self.error}); it runs kernel by kernel", RuntimeWarning, stacklevel=3)
            return None
        return graph, out
