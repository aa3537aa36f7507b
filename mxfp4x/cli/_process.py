"""What the measuring commands read about this process (torch's thread count is set
through ``mxfp4x._core.threads.torch_threads``)."""


def rss_mapped():
    """(resident, mapped file-backed) bytes of this process (Linux; zeros elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        rss = int(fields["VmRSS"].split()[0]) * 1024
        mapped = 0
        with open("/proc/self/smaps") as f:
            path = ""
            for line in f:
                parts = line.split()
                if len(parts) >= 5 and "-" in parts[0] and ":" not in parts[0]:
                    path = parts[5] if len(parts) >= 6 else ""  # a new mapping
                elif parts and parts[0] == "Size:" and path.endswith(".safetensors"):
                    mapped += int(parts[1]) * 1024
        return rss, mapped
    except (OSError, KeyError, ValueError):
        return 0, 0


def default_threads():
    from mxfp4x._core import threads as _threads

    return _threads.resolve(None)


# batches larger than this are timed once: each call takes seconds at model size
REPEATED_UP_TO = 64


def repeats(n_tokens, asked):
    return asked if n_tokens <= REPEATED_UP_TO else 1
