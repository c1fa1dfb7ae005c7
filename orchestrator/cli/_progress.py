"""Progress of a long command on stderr: a rich live display on a terminal, plain periodic lines when piped.

A log file or CI output gets a line at each change of step, and the latest state again every
``every_s`` seconds while the step goes on (never a spinner's control codes); a terminal gets a bar,
the counts and the details in place. stdout stays the command's answer alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    """What a command is doing, as it goes (a context manager).

    Args:
      title: what the first line says (e.g. "capturing gpt-tiny").
      every_s: when piped, the time between two lines of one step (the latest state is repeated when
        nothing new came, so a log shows the command is alive).
      console: where to show it (default: stderr).
      clock: seconds, for the elapsed time and the line rate (a test gives its own).

    Example:
      >>> with Progress("planning") as shown:  # doctest: +SKIP
      ...     shown.update("planning: pieces", completed=3, total=10, detail="gap 4.2%")
    """

    def __init__(
        self,
        title: str,
        *,
        every_s: float = 5.0,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self.every_s, self.clock = every_s, clock
        self.description = title
        self.started = self._last = clock()
        self._bar: RichProgress | None = None
        self._task = None
        self._counts: tuple[int | None, int | None] = (None, None)  # (completed, total)
        self._detail = ""
        self._text = title  # the latest state, as a piped line shows it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.live:
            self._bar = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=None, detail="")
        else:
            self._line(self.description)
            self._ticker = threading.Thread(target=self._tick, name="orchestrator-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.clock() - self._last >= self.every_s:
                self._line(self._text)

    def update(
        self,
        description: str | None = None,
        *,
        completed: int | None = None,
        total: int | None = None,
        detail: str | None = None,
        force: bool = False,
    ) -> None:
        """Show where the command stands. What is not given stays as it was, unless the ``description``
        (the step) changes, which clears the counts and the detail. A new step is always shown; when
        piped, the same step again only after ``every_s`` seconds, unless ``force``."""
        if description is not None and description != self.description:
            self.description, self._counts, self._detail = description, (None, None), ""
            force = True
        self._counts = (
            self._counts[0] if completed is None else completed,
            self._counts[1] if total is None else total,
        )
        self._detail = self._detail if detail is None else detail
        done, of = self._counts
        if self._bar is not None:
            self._bar.update(self._task, description=self.description, completed=done or 0, total=of)
            self._bar.update(self._task, detail=self._detail)
            return
        counts = f" {done}/{of}" if done is not None and of else ""
        self._text = f"{self.description}{counts}" + (f" · {self._detail}" if self._detail else "")
        if force or self.clock() - self._last >= self.every_s:
            self._line(self._text)

    def _line(self, text: str) -> None:
        with self._lock:
            now = self._last = self.clock()
            self.console.print(f"{text} · {now - self.started:.1f} s", markup=False, highlight=False, soft_wrap=True)


def _duration(seconds: float) -> str:
    """``12.5 ms`` below a second, ``4.259 s`` from one on."""
    return f"{seconds:.4g} s" if seconds >= 1 else f"{seconds * 1e3:.4g} ms"


def show_search(shown: Progress, what: str = "planning"):
    """A ``plan(progress=...)`` observer that shows the search on ``shown``: its step, the pieces solved,
    the incumbent's step time, the bound and the gap."""

    def observe(progress) -> None:  # an orchestrator.planner.SearchProgress
        facts = []
        if progress.incumbent_s is not None:
            facts.append(f"incumbent {_duration(progress.incumbent_s)}")
        if progress.bound_s is not None and progress.gap is not None:
            facts.append(f"bound {_duration(min(progress.bound_s, progress.incumbent_s))}")
            facts.append(f"gap {progress.gap:.2%}")
        solved = progress.pieces_solved if progress.pieces else None
        shown.update(
            f"{what}: {progress.step}", completed=solved, total=progress.pieces or None, detail=" · ".join(facts)
        )

    return observe


def show_steps(shown: Progress, total: int):
    """A training callback (``integrations.callbacks.Callback``) that shows each step on ``shown``: its
    loss, its measured time (until its metrics are ready) and the plan's predicted step time.

    Waiting for each step's metrics keeps the next step's dispatch from overlapping this one's
    compute; that is the price of a measured time per step.
    """
    from integrations.callbacks import Callback

    class Steps(Callback):
        predicted_s: float | None = None
        started = 0.0

        def on_train_begin(self, *, state=None, plan=None) -> None:
            self.predicted_s = None if plan is None else plan.iteration_s

        def on_step_begin(self, step: int) -> None:
            self.started = time.perf_counter()
            if shown.description != "training":  # the first step after the capture and placement
                shown.update("training", completed=step, total=total)

        def on_step_end(self, step: int, metrics, *, state=None) -> None:
            import jax

            jax.block_until_ready(metrics)
            measured_s = time.perf_counter() - self.started
            facts = [] if "loss" not in metrics else [f"loss {float(metrics['loss']):.4f}"]
            facts.append(f"step {measured_s * 1e3:.1f} ms")
            if self.predicted_s is not None:
                facts.append(f"predicted {self.predicted_s * 1e3:.3g} ms")
            shown.update("training", completed=step + 1, total=total, detail=" · ".join(facts))

    return Steps()
