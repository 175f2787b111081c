"""benchmarks/throughput.py's co-located processes start together on a signal file that is never read half-written."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from throughput import read_start_signal, write_start_signal  # noqa: E402


def test_a_signal_caught_mid_write_is_read_again(tmp_path):
    go = tmp_path / "go"
    go.touch()  # what a poller saw when Path.write_text had created the file but not yet written it

    def finish_writing():
        time.sleep(0.1)
        go.write_text("1234.5")

    writer = threading.Thread(target=finish_writing)
    writer.start()
    assert read_start_signal(go, deadline=time.time() + 5) == 1234.5
    writer.join()


def test_the_signal_appears_whole(tmp_path):
    seen: list[str] = []
    stop = threading.Event()

    def poll(path: Path):
        while not stop.is_set():
            if path.exists():
                seen.append(path.read_text())
                return

    for i in range(200):
        path = tmp_path / f"go-{i}"
        stop.clear()
        reader = threading.Thread(target=poll, args=(path,))
        reader.start()
        write_start_signal(path, 1000.0 + i)
        reader.join(timeout=5)
        stop.set()
    assert len(seen) == 200 and all(text and float(text) >= 1000.0 for text in seen)
