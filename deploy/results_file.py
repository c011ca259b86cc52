"""The JSONL files of deploy.generate: requests read lazily, results appended and flushed one by one,
and what --resume needs (the ids already written, a torn last line cut off)."""
from __future__ import annotations

import json
import os
import queue
import threading

from raymoe.stages.errors import RaymoeError


def local_jsonl(path: str) -> bool:
    """A path the simple in-driver job reads or writes; anything else (a name ending in .parquet or /,
    a folder, a URI) goes through Ray Data."""
    return "://" not in path and not path.endswith((".parquet", "/")) and not os.path.isdir(path)


def read_lines(path: str):
    """Open the input now (an unreadable file fails before any work); the iterator yields
    (id, request or None, error or None) for each non-blank line, lazily. A line's id defaults to
    its index among the non-blank lines."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise RaymoeError(f"{path}: cannot read input ({e.strerror or e})") from None

    def lines():
        with f:
            index = 0
            try:
                for line in f:
                    if line.strip():
                        yield parse_line(line, index)
                        index += 1
            except UnicodeDecodeError as e:
                raise RaymoeError(f"{path}: line {index + 1} is not UTF-8 ({e.reason})") from None
    return lines()


class LineReader:
    """The lines of read_lines, read ahead by a thread into a bounded queue, so that a slow input (a
    pipe) never keeps the job from collecting and writing the results that finish meanwhile."""

    END = object()

    def __init__(self, lines, ahead: int):
        self.queue: queue.Queue = queue.Queue(maxsize=ahead)
        self.closed = threading.Event()
        threading.Thread(target=self._read, args=(lines,), daemon=True, name="input-reader").start()

    def _read(self, lines):
        try:
            for line in lines:
                if not self._put(line):
                    return
            self._put(self.END)
        except RaymoeError as e:
            self._put(e)
        finally:
            lines.close()

    def _put(self, item) -> bool:
        while not self.closed.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                pass
        return False

    def close(self):
        """The job ended early: the reading thread stops and closes the input."""
        self.closed.set()

    def get(self, timeout: float):
        """The next line, END, or None when none came within timeout."""
        try:
            item = self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, RaymoeError):
            raise item
        return item


def parse_line(line: str, index: int | None) -> tuple[object, dict | None, str | None]:
    """index None: the line's position is unknown (Ray Data inputs), so it must carry its id."""
    where = f"line {index + 1}" if index is not None else "row"
    try:
        request = json.loads(line)
    except json.JSONDecodeError as e:
        return index, None, f"{where} is not valid JSON ({e.msg})"
    if not isinstance(request, dict):
        return index, None, f"{where} is not a JSON object"
    rid = request.get("id")
    if rid is None and index is None:
        return None, None, "row has no \"id\" (rows read through Ray Data must carry one)"
    return index if rid is None else rid, request, None


def id_key(rid) -> str:
    """Ids are any JSON value; 7 and "7" are different ids."""
    return json.dumps(rid, sort_keys=True, ensure_ascii=False)


class ResultWriter:
    """Appends result lines to a JSONL file, each written and flushed as it comes. Opened before any
    work, so an unwritable path fails first. With resume, a torn last line (a job killed mid-write) is
    cut off and the ids already written are kept in `done` (held in memory: ~100 bytes an id)."""

    def __init__(self, path: str, resume: bool):
        self.done: set[str] = set()
        try:
            if resume and os.path.exists(path):
                self.done = read_done_ids(path)
                self.file = open(path, "a", encoding="utf-8")
            else:
                self.file = open(path, "w", encoding="utf-8")
        except OSError as e:
            raise RaymoeError(f"{path}: cannot write output ({e.strerror or e})") from None

    def write(self, result: dict):
        self.file.write(json.dumps(result, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self):
        self.file.close()


def read_done_ids(path: str) -> set[str]:
    """The ids of an earlier run's output, after cutting a torn last line (one without its newline)."""
    done, offset = set(), 0
    with open(path, "rb+") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                f.truncate(offset)
                break
            offset += len(line)
            try:
                rid = json.loads(line)["id"]
            except (ValueError, TypeError, KeyError):
                raise RaymoeError(f"{path}: line {number} is not a result line, so --resume cannot tell what is "
                                  f"done; choose another output") from None
            if rid is not None:       # null: a Ray Data row without an id, which no rerun can match
                done.add(id_key(rid))
    return done
