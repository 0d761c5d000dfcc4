"""Named ranges of the training step: visible to `torch.profiler`, and timed on the GPU when asked.

    with RangeTimer(device) as timer:        # bench/bench_distill.py
        distiller.train_step(batch)
    timer.totals()                           # {"kvpop.target": ms, ...}

Each `timed(name)` range is a `record_function` (free unless a profiler runs). Inside a
`RangeTimer`, it also records a pair of CUDA events on the current stream, so the time is the GPU's
own, launch queueing included, and a range around `.backward()` holds every backward kernel (they
run on the forward's stream). No host sync happens until `totals()`.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.profiler import record_function

_active: RangeTimer | None = None


class RangeTimer:
    """Collects the `timed` ranges run while it is entered (one at a time per process)."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.spans: list[tuple[str, object, object]] = []

    def __enter__(self) -> RangeTimer:
        global _active
        if _active is not None:
            raise RuntimeError("a RangeTimer is already active")
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def totals(self) -> dict[str, float]:
        """Milliseconds per range name, summed over every time it ran (synchronises once)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for name, start, end in self.spans:
            out[name] += start.elapsed_time(end) if self.cuda else (end - start) * 1e3
        return dict(out)


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """A named range: a profiler annotation, and a timed span inside a `RangeTimer`."""
    with record_function(name):
        timer = _active
        if timer is None:
            yield
            return
        start = timer.mark()
        yield
        timer.spans.append((name, start, timer.mark()))
