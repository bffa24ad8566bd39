"""A live progress bar per load level (rich), counting completed and not-completed requests.

Silent when the output is not a terminal (CI logs, pipes) or when asked to be.
"""

from __future__ import annotations

from typing import Any

from inferlab.bench.records import RequestRecord


class LiveProgress:
    """`with LiveProgress(enabled) as p: cb = p.level("rate 4/s", n); run_load(..., progress=cb)`."""

    def __init__(self, enabled: bool = True, console: Any | None = None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self._progress = None

    def __enter__(self) -> LiveProgress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[errors]} not ok"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None

    def level(self, description: str, total: int):
        """A callback for `run_load(progress=...)` that advances this level's bar."""
        if self._progress is None:
            return None
        task = self._progress.add_task(description, total=total, errors=0)
        errors = 0

        def update(done: int, _total: int, rec: RequestRecord) -> None:
            nonlocal errors
            errors += 0 if rec.ok else 1
            self._progress.update(task, completed=done, errors=errors)

        return update
