"""A progress bar for long loads and writes."""


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a few plain lines
    otherwise (no carriage-return noise in logs)."""

    def __init__(self, total: int, label: str, stream=None):
        import sys

        self.total, self.label = max(1, total), label
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = -1

    def update(self, done: int):
        frac = done / self.total
        if self.tty:
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r{self.label} [{bar:30s}] {done}/{self.total}")
            if done >= self.total:
                self.stream.write("\n")
        else:
            step = int(4 * frac)  # 0%, 25%, 50%, 75%, 100%
            if step == self._last:
                return
            self._last = step
            self.stream.write(f"{self.label}: {done}/{self.total}\n")
        self.stream.flush()
