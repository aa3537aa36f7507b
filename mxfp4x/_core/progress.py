"""A progress bar for long loads, writes and measurements."""


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a few plain lines
    otherwise (no carriage-return noise in logs).  ``note`` says what the step under way
    is doing; :meth:`clear` makes room on a terminal for a line printed between steps."""

    def __init__(self, total: int, label: str, stream=None):
        import sys

        self.total, self.label = max(1, total), label
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = -1
        self._width = 0  # of the line drawn last on a terminal

    def update(self, done: int, note: str = ""):
        frac = done / self.total
        note = f" {note}" if note else ""
        if self.tty:
            bar = "#" * int(30 * frac)
            line = f"{self.label} [{bar:30s}] {done}/{self.total}{note}"
            self.stream.write("\r" + line.ljust(self._width))  # over a longer note too
            self._width = len(line)
            if done >= self.total:
                self.stream.write("\n")
                self._width = 0
        else:
            step = int(4 * frac)  # 0%, 25%, 50%, 75%, 100%
            if step == self._last:
                return
            self._last = step
            self.stream.write(f"{self.label}: {done}/{self.total}{note}\n")
        self.stream.flush()

    def clear(self):
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
