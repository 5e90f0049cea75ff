"""Progress of a long phase (the SFT's steps, an RL run's samples): a tqdm bar redrawn in place on a terminal;
elsewhere (a log file, a pipe, CI) one plain line each time another `every` of the total is done, so a log
holds about 1 / every lines per bar, not one per update.

    with Progress(300, "SFT", unit="step") as bar:
        for step in range(300):
            ...
            bar.update()
            bar.write("eval ...")     # a line above the bar (plain print when there is no terminal)

`echo(line)` prints a line above whatever bar is open (the console metrics sink prints through it).
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


def echo(line: str) -> None:
    """Print `line` to stdout above any open tqdm bar (a plain print when none is open), flushed."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


class Progress:
    """`done / total` units of one phase, on `file` (default: stdout at construction).

    Args:
        total: units the phase is expected to take (`update` past it raises the total: an estimate may be low).
        desc: the phase's name, first on every line.
        unit: what is counted ("step", "sample").
        every: on a non-terminal `file`, print a line each time `done` crosses another multiple of
            `every * total` (and at the end); 0.1: about 10 lines.
        file: where to draw; None: `sys.stdout` now.
    """

    def __init__(self, total: int, desc: str, *, unit: str = "it", every: float = 0.1, file=None) -> None:
        if total < 1:
            raise ValueError(f"Progress total={total} must be >= 1")
        if not 0 < every <= 1:
            raise ValueError(f"Progress every={every} must be in (0, 1]")
        self.file = sys.stdout if file is None else file
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.done = 0
        self.start = time.perf_counter()
        self._printed = 0  # the multiples of every * total already printed (non-terminal)
        self._line_at = -1  # `done` when the last plain line was printed
        tty = getattr(self.file, "isatty", lambda: False)()
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file, dynamic_ncols=True, leave=True) if tty \
            else None

    def update(self, n: int = 1) -> None:
        """`n` more units are done."""
        self.done += n
        if self.done > self.total:
            self.total = self.done
            if self.bar is not None:
                self.bar.total = self.total
        if self.bar is not None:
            self.bar.update(n)
            return
        mark = int(self.done / (self.every * self.total) + 1e-9)
        if mark > self._printed:
            self._printed = mark
            self._line()

    def write(self, line: str) -> None:
        """Print `line` above the bar (a plain line without a terminal)."""
        if self.bar is not None:
            self.bar.write(line, file=self.file)
        else:
            print(line, file=self.file, flush=True)

    def close(self) -> None:
        """End the bar; without a terminal, a last line unless the last one printed already said `done`."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self._line_at != self.done:
            self._line()

    def _line(self) -> None:
        self._line_at = self.done
        elapsed = time.perf_counter() - self.start
        left = f", ~{elapsed / self.done * (self.total - self.done):.0f} s left" if 0 < self.done < self.total else ""
        print(f"{self.desc}: {self.done}/{self.total} {self.unit}s ({100 * self.done / self.total:.0f}%) "
              f"{elapsed:.0f} s{left}", file=self.file, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
