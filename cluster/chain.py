"""A stage's link to the other stages of its node over the shm transport's rings, and decode steps chained
through them: a call of several decode steps of its sequences (StepBatch.follow) runs through every stage
without going back to the coordinator between steps, as a one-stage pipeline does (docs/ray-step.md).

- Activations go forward one message per step, or an end mark where the first stage stops the call early
  (its sequence ended); every later stage stops at that mark and passes it on.
- The last stage passes every token it samples back to the first over one more ring, as (sequence, position it
  is input at, token), -1 where the sampling failed. The first stage keeps the newest per sequence, as a
  one-stage pipeline keeps what it sampled (Stage.sampled); a step planned before its token was back waits for
  it here. It reads what came at the start of every call, so the ring never fills.
- A stage that fails a step tells the stages that wait on it: the next one down its ring, the first one
  (from the last stage) over the ring back, so that none is left waiting.
"""
from __future__ import annotations

import time

import torch

from .shm import Ring

FAILED_TOKEN = -1


class ChainLink:
    def __init__(self):
        self.ring_in: Ring | None = None      # from the previous stage
        self.ring_out: Ring | None = None     # to the next stage
        self.back: Ring | None = None         # the ring from the last stage to the first (its end in this stage)
        # called before this stage hands the computation to another (a stage sharing its node's cores frees them)
        self.on_hand_over = None
        self.tokens: dict[int, tuple[int, int | None]] = {}    # first stage: seq_id -> (position, token or None)
        # first stage: whether it still holds a sequence (its caches); a token that comes back after the sequence
        # was released is not kept
        self.holds = None
        self.waited_s = 0.0                   # seconds spent waiting on the other stages

    def close(self):
        for ring in (self.ring_in, self.ring_out, self.back):
            if ring is not None:
                ring.close()
        self.ring_in = self.ring_out = self.back = None
        self.tokens.clear()

    def forward(self, batch, compute):
        """One call of this stage: read the previous stage's activations, compute(batch, hidden), write the result
        to the next stage; the last stage returns it. A chain of steps (a follow batch) moves its activations
        step by step inside compute (Stage.forward over this link). A failure is passed on to the stages that
        wait on this one (send_failure) before it is raised."""
        try:
            if batch.follow:
                return compute(batch, None)
            if self.back is not None and self.ring_in is None:     # the first stage: keep the tokens passed back
                self.drain()
            hidden = self.recv() if self.ring_in is not None else None
            out = compute(batch, hidden)
            if self.ring_out is None:
                return out
            self.send(out)
            return None
        except BaseException as e:
            self.send_failure(isinstance(e, MemoryError))
            raise

    def _wait(self, read):
        start = time.perf_counter()
        try:
            return read()
        finally:
            self.waited_s += time.perf_counter() - start

    # ---- activations, forward -------------------------------------------------------------
    def recv(self, end_ok: bool = False) -> torch.Tensor | None:
        """The previous stage's activations for this step; None for the end of a chain (where end_ok)."""
        return self._wait(lambda: self.ring_in.recv(end_ok))

    def _hand_over(self):
        if self.on_hand_over is not None:
            self.on_hand_over()

    def send(self, x: torch.Tensor):
        self._hand_over()
        self.ring_out.send(x)

    def end(self):
        """This call's steps end here: the later stages stop at this mark."""
        self._hand_over()
        self.ring_out.send_end()

    def send_failure(self, out_of_memory: bool = False):
        """This stage failed its step: the stages waiting on it fail it too."""
        if self.ring_out is not None:
            self.ring_out.send_failure(out_of_memory)
        elif self.back is not None:     # the last stage: the first may wait for a token from it
            self.back.send_failure()

    # ---- sampled tokens, back ---------------------------------------------------------------
    def pass_back(self, entries: list[tuple[int, int, int | None]]):
        """Last stage: (seq_id, position the token is input at, token or None where sampling failed) of a step."""
        if entries:
            self._hand_over()
            self.back.send(torch.tensor([[s, p, FAILED_TOKEN if t is None else t] for s, p, t in entries],
                                        dtype=torch.int64))

    def drain(self):
        """First stage: keep what the last stage has passed back so far, without waiting."""
        while self.back.ready():
            self._keep(self.back.recv())

    def next_tokens(self, seq_ids: list[int], positions: list[int], end_ids: list[frozenset]) -> list[int] | None:
        """First stage: the tokens the last stage sampled for these sequences to input at these positions, waiting
        for those not back yet; None where a sequence ended before (a token of its end_ids, or a failed sampling).
        An ended sequence is looked for in what is back before waiting: a call sent before the end was known asks
        the others for positions that will never come."""
        while True:
            tokens = []
            for seq_id, position, ends in zip(seq_ids, positions, end_ids):
                pos, token = self.tokens.get(seq_id, (None, None))
                if pos is not None and pos > position:
                    raise RuntimeError(f"sequence {seq_id}: a token for position {pos} came back where {position} "
                                       f"was due")
                if pos is not None and (token is None or token in ends):
                    return None
                tokens.append(token if pos == position else None)
            if None not in tokens:
                return tokens
            self._keep(self._wait(self.back.recv))

    def _keep(self, message: torch.Tensor):
        for seq_id, position, token in message.tolist():
            if self.holds is None or self.holds(seq_id):
                self.tokens[seq_id] = (position, None if token == FAILED_TOKEN else token)

    def forget(self, seq_id: int):
        self.tokens.pop(seq_id, None)
