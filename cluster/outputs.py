"""Where each sequence's output goes, apart from how it is scheduled: a server's sequence streams its
updates to a reader (stream()); a batch job's sequence is collected when it finishes (wait_finished()).
The coordinator publishes each step's new tokens here and asks nothing back but whether a reader
went away."""
from __future__ import annotations

import asyncio


class Outputs:
    def __init__(self):
        self.queues: dict[int, asyncio.Queue] = {}      # seq_id -> stream of updates
        self.text_sent: dict[int, int] = {}             # seq_id -> characters of its text streamed so far
        self.finished: list[tuple[int, dict]] = []      # collected results not yet taken by wait_finished
        self.finished_event = asyncio.Event()
        self.uncollected: set[int] = set()              # results only streamed, never kept for wait_finished
        self.streaming: set[int] = set()                # sequences with a stream() reader

    def add(self, seq_id: int, collect: bool):
        """A new sequence; collect=False: its result only goes to its stream (a server's)."""
        if not collect:
            self.uncollected.add(seq_id)
            self.queues[seq_id] = asyncio.Queue()

    async def wait_finished(self, timeout: float) -> list[tuple[int, dict]]:
        """(seq_id, result) of the collected sequences finished since the last call (waits up to timeout)."""
        if not self.finished:
            self.finished_event.clear()
            try:
                await asyncio.wait_for(self.finished_event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        out, self.finished = self.finished, []
        return out

    def open_stream(self, seq_id: int, running: bool) -> asyncio.Queue | None:
        """The queue of seq_id's updates for a reader (a running batch job's sequence: from now on),
        or None for a sequence it does not know."""
        queue = self.queues.get(seq_id)
        if queue is None and running:
            queue = self.queues[seq_id] = asyncio.Queue()
        if queue is not None:
            self.streaming.add(seq_id)
        return queue

    def close_stream(self, seq_id: int, finished: bool) -> bool:
        """The reader is done; whether it left before the end of a server's sequence (so it is abandoned)."""
        self.streaming.discard(seq_id)
        if finished:
            self.queues.pop(seq_id, None)
        return not finished and seq_id in self.uncollected

    def publish(self, seq, new_ids: list[int], first_index: int, final: bool = False):
        """New tokens of seq (its logprobs from first_index on); final: with its result."""
        queue = self.queues.get(seq.seq_id)
        if queue is None and not final:     # nobody streams it (a batch job's sequence)
            return
        update = {"token_ids": list(new_ids), "text_delta": seq.text[self.text_sent.get(seq.seq_id, 0):],
                  "logprobs": seq.logprobs[first_index:] if seq.logprobs is not None else None}
        self.text_sent[seq.seq_id] = len(seq.text)
        if final:
            result = seq.result()
            update["finished"] = result
            self.text_sent.pop(seq.seq_id, None)
            if seq.seq_id in self.uncollected:
                self.uncollected.discard(seq.seq_id)
                if seq.cancelled and seq.seq_id not in self.streaming:
                    self.queues.pop(seq.seq_id, None)     # its reader went away before it started reading
                    queue = None
            else:
                self.finished.append((seq.seq_id, result))
                self.finished_event.set()
        if queue is not None:
            queue.put_nowait(update)
