"""Metrics as JSON lines in the run directory (rank 0 writes; others hold a disabled writer)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any


class MetricsWriter:
    def __init__(self, path: str | Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._f: IO[str] | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a")

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps({"time": time.time(), **record}) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
