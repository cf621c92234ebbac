"""Where peagle keeps what it makes once (converted models, GGUF metadata, built kernels): $PEAGLE_HOME, and the
lock under which concurrent first runs make each thing once."""
from __future__ import annotations

import os
from pathlib import Path


def peagle_home() -> Path:
    return Path(os.environ.get("PEAGLE_HOME", Path.home() / ".cache" / "peagle"))


class file_lock:
    """An exclusive advisory lock on `path`, so that concurrent first runs make a thing once."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl

        self.fd = open(self.path, "w")
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.fd.close()
