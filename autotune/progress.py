"""What a user sees while kernels build: one progress bar per run, and no compiler chatter.

`KernelProgress` shows the kernel being built, i/N and the elapsed time: a live tqdm bar on a
terminal, one line per finished kernel otherwise (a log file or CI output gets no carriage
returns). `quiet_tilelang` hides TileLang's INFO lines (a "begins/completes to compile" pair per
kernel, which would scroll the bar away) while it is active; warnings and errors still reach the
user. Both belong to the compile side: tqdm comes with TileLang.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Iterator, TextIO

PRINT_ON_COMPILATION = "TILELANG_PRINT_ON_COMPILATION"  # read by tilelang.env on every compile


@contextlib.contextmanager
def quiet_tilelang() -> Iterator[None]:
    """TileLang's logger at WARNING and its per-compile print off; both restored on exit."""
    logger = logging.getLogger("tilelang")
    level, printing = logger.level, os.environ.get(PRINT_ON_COMPILATION)
    logger.setLevel(max(level, logging.WARNING))
    os.environ[PRINT_ON_COMPILATION] = "0"
    try:
        yield
    finally:
        logger.setLevel(level)
        if printing is None:
            os.environ.pop(PRINT_ON_COMPILATION, None)
        else:
            os.environ[PRINT_ON_COMPILATION] = printing


def _terminal_width(stream) -> int:
    """Columns of the terminal `stream` writes to; 0 when it is none (a file, a pipe) or reports no
    size (some pseudo-terminals), where a live bar would render as nothing."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
    except (OSError, ValueError, AttributeError):
        return 0


class KernelProgress:
    """Progress over `total` kernel builds; `start(label)` before each, `done(result)` after."""

    def __init__(self, total: int, stream: TextIO | None = None, live: bool | None = None):
        self.total, self.count, self.t0 = total, 0, time.perf_counter()
        self.stream = stream or sys.stderr
        self.label = ""
        self._bar = None
        if _terminal_width(self.stream) > 0 if live is None else live:
            from tqdm import tqdm

            self._bar = tqdm(total=total, file=self.stream, unit="kernel", dynamic_ncols=True,
                             bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}")

    def start(self, label: str) -> None:
        self.label = label
        if self._bar is not None:
            self._bar.set_description_str(label)

    def done(self, result=None) -> None:
        """One kernel finished (a tuner BuildResult: `reused` says it was already in the cache)."""
        self.count += 1
        if self._bar is not None:
            self._bar.update(1)
            return
        how = "cached" if getattr(result, "reused", False) else "built"
        self.stream.write(f"[{self.count}/{self.total}] {self.label}: {how} "
                          f"({time.perf_counter() - self.t0:.0f}s elapsed)\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_description_str(f"built {self.total} kernel(s)")
            self._bar.close()

    def __enter__(self) -> "KernelProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
