"""What a user sees while kernels build: progress with a time estimate, no compiler chatter, a clean Ctrl-C.

`KernelProgress` shows one group's (one head shape's) kernel being built, i/N and the elapsed time:
a live tqdm bar on a terminal, one line per finished kernel otherwise (a log file or CI output gets
no carriage returns). `TuneProgress` does the same on stderr for a whole tune: groups and kernels
done of their totals, elapsed, and the time left estimated from the kernels compiled so far
(kernels found in the cache take no time and do not count towards the rate). `quiet_tilelang` hides
TileLang's INFO lines (a "begins/completes to compile" pair per kernel, which would scroll the bar
away) while it is active; warnings and errors still reach the user. `catching_sigint` remembers a
Ctrl-C, which TileLang's compiler can turn into another exception on its way up. tqdm comes with
TileLang, so all of this belongs to the compile side.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
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
    """Progress over `total` kernel builds; `start(label)` before each, `done(result)` after. With
    `overall` (a TuneProgress), each call is passed on to it, and a live overall bar replaces this
    one's: its lines are then written around that bar."""

    def __init__(self, total: int, stream: TextIO | None = None, live: bool | None = None,
                 overall: "TuneProgress | None" = None):
        self.total, self.count, self.t0 = total, 0, time.perf_counter()
        self.stream = stream or sys.stderr
        self.label = ""
        self.overall = overall
        self._bar = None
        if overall is not None and overall.live:
            live = False
        if _terminal_width(self.stream) > 0 if live is None else live:
            from tqdm import tqdm

            self._bar = tqdm(total=total, file=self.stream, unit="kernel", dynamic_ncols=True,
                             bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}")

    def start(self, label: str) -> None:
        self.label = label
        if self._bar is not None:
            self._bar.set_description_str(label)
        if self.overall is not None:
            self.overall.start(label)

    def done(self, result=None) -> None:
        """One kernel finished (a tuner BuildResult: `reused` says it was already in the cache)."""
        self.count += 1
        if self._bar is not None:
            self._bar.update(1)
        else:
            how = "cached" if getattr(result, "reused", False) else "built"
            line = f"[{self.count}/{self.total}] {self.label}: {how} ({time.perf_counter() - self.t0:.0f}s elapsed)\n"
            if self.overall is not None:
                self.overall.write(line, self.stream)
            else:
                self.stream.write(line)
                self.stream.flush()
        if self.overall is not None:
            self.overall.done(result)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_description_str(f"built {self.total} kernel(s)")
            self._bar.close()

    def __enter__(self) -> "KernelProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def duration(seconds: float) -> str:
    """'45s', '5m12s', '1h02m': how a progress line states a time."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"


class TuneProgress:
    """A whole tune's progress on `stream` (stderr): groups and kernels done of their totals, the
    elapsed time and the time left, estimated as the mean time of the kernels compiled so far times
    the kernels left. A live bar on a terminal (lines written to the terminal meanwhile go through
    `write`), else one line per finished kernel."""

    def __init__(self, groups: int, kernels: int, stream: TextIO | None = None, live: bool | None = None):
        self.groups, self.kernels = groups, kernels
        self.group, self.count, self.built, self.built_s = 0, 0, 0, 0.0
        self.stream = stream or sys.stderr
        self.label, self.t0, self._since = "", time.perf_counter(), time.perf_counter()
        self.live = _terminal_width(self.stream) > 0 if live is None else live
        self._bar = None
        if self.live:
            from tqdm import tqdm

            self._bar = tqdm(total=kernels, file=self.stream, unit="kernel", dynamic_ncols=True,
                             bar_format="{desc} {n_fmt}/{total_fmt} kernels{postfix} |{bar}|")

    def start_group(self, index: int) -> None:
        """Group `index` (from 0) begins."""
        self.group = index + 1

    def start(self, label: str) -> None:
        self.label, self._since = label, time.perf_counter()
        if self._bar is not None:
            self._bar.set_description_str(f"[{self.group}/{self.groups}] {label}", refresh=False)
            self._bar.set_postfix_str(self.times(), refresh=True)

    def done(self, result=None) -> None:
        self.count += 1
        if not getattr(result, "reused", False):
            self.built += 1
            self.built_s += time.perf_counter() - self._since
        if self._bar is not None:
            self._bar.set_postfix_str(self.times(), refresh=False)
            self._bar.update(1)
            return
        self.stream.write(f"overall: {self.count}/{self.kernels} kernels, group {self.group}/{self.groups}, "
                          f"{self.times()}\n")
        self.stream.flush()

    def left_s(self) -> float | None:
        """Estimated seconds left (None before the first compiled kernel)."""
        if not self.built:
            return None
        return self.built_s / self.built * (self.kernels - self.count)

    def times(self) -> str:
        left = self.left_s()
        eta = "time left unknown until a kernel is compiled" if left is None else f"about {duration(left)} left"
        return f"{duration(time.perf_counter() - self.t0)} elapsed, {eta}"

    def write(self, text: str, stream: TextIO | None = None) -> None:
        """Write `text` to `stream` (default stdout) without garbling the live bar."""
        stream = stream or sys.stdout
        if self._bar is not None:
            self._bar.clear()
        stream.write(text)
        stream.flush()
        if self._bar is not None:
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "TuneProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SigintFlag:
    """Whether a Ctrl-C arrived (`hit`)."""

    hit = False


@contextlib.contextmanager
def catching_sigint() -> Iterator[SigintFlag]:
    """While active, a Ctrl-C (SIGINT) still raises KeyboardInterrupt but is also remembered: code in
    between (TileLang's FFI, a compiler subprocess killed by the same Ctrl-C) may turn it into
    another exception. The previous handler is restored on exit. Outside the main thread, no handler
    can be installed and only a KeyboardInterrupt says so."""
    flag = SigintFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        flag.hit = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
