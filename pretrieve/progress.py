"""Progress of long commands: a tqdm bar with ETA on a terminal, plain periodic log lines elsewhere.

A bar redrawn with carriage returns turns a SLURM log or a piped file into one unreadable line, so when
stderr is not a terminal the same progress is written as lines like
`encode corpus: 40/125 batch (32%), 0:00:31 elapsed, ETA 0:01:06`, at most one per `every_s` seconds or per
tenth of the total (whichever comes first), plus a last line when it finishes.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class Progress:
    """Counts units done out of `total`, from `initial` (a resumed run); use as a context manager, call
    `update(n)`, and `postfix(name=value, ...)` for figures shown beside the count (a loss)."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", enabled: bool = True,
                 stream: TextIO | None = None, every_s: float = 30.0, leave: bool = True, initial: int = 0):
        self.total, self.desc, self.unit = total, desc, unit
        self.done = self.last_done = self.initial = initial
        self.stream = stream or sys.stderr
        self.enabled, self.every_s = enabled, every_s
        self.started = self.last_time = time.monotonic()
        self.figures: dict[str, str] = {}
        self.shown_figures: dict[str, str] = {}  # those of the last line logged
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=leave, dynamic_ncols=True,
                            initial=initial)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and self._due():
            self._log()

    def postfix(self, **figures: str) -> None:
        self.figures = figures
        if self.bar is not None:
            self.bar.set_postfix(figures)

    def show(self) -> None:
        """Log the line now, unless the last one showed this count and these figures (a terminal's bar shows
        them already): the last word of a run that a health alarm stops."""
        if self.bar is None and self.enabled and (self.done, self.figures) != (self.last_done, self.shown_figures):
            self._log()

    def note(self, message: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def _due(self) -> bool:
        now = time.monotonic()
        tenth = self.total and self.done - self.last_done >= max(1, (self.total - self.initial) // 10)
        return bool(tenth) or now - self.last_time >= self.every_s

    def _log(self) -> None:
        elapsed = time.monotonic() - self.started
        line = f"{self.desc}: {self.done}"
        if self.total:
            line += f"/{self.total} {self.unit} ({100 * self.done / self.total:.0f}%)"
        else:
            line += f" {self.unit}"
        line += f", {_clock(elapsed)} elapsed"
        if self.total and self.done >= self.total:
            line += ", done"
        elif self.total and self.done > self.initial:
            line += f", ETA {_clock(elapsed * (self.total - self.done) / (self.done - self.initial))}"
        line += "".join(f", {name} {value}" for name, value in self.figures.items())
        print(line, file=self.stream, flush=True)
        self.last_time, self.last_done, self.shown_figures = time.monotonic(), self.done, dict(self.figures)

    def close(self, failed: bool = False) -> None:
        """The last line (the bar left in place on a terminal); none when `failed`: the error is the last word,
        and a generator closed after its consumer's error must not print below it."""
        if self.bar is not None:
            if failed:
                self.bar.leave = False
            self.bar.close()
        elif self.enabled and not failed and self.done > self.initial and self.done != self.last_done:
            self._log()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)  # GeneratorExit too: a generator its consumer gave up on


def track(items: Iterable[T], desc: str, unit: str = "it", total: int | None = None, enabled: bool = True,
          leave: bool = True) -> Iterator[T]:
    """`items`, counted one unit each by a Progress (total: len(items) when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(total, desc, unit, enabled, leave=leave) as progress:
        for item in items:
            yield item
            progress.update()
