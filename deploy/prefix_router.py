"""Prefix-aware routing over a model's Pipeline replicas, through Serve's request-router API.

Each replica has a prefix cache of its own (docs/prefix-cache.md), so a conversation's next turn is fastest where
its history was computed. The router remembers, per block of BLOCK_TOKENS prompt tokens (a chain of hashes: a block
stands for the whole prefix up to its end), the replica it last sent that prefix to. A generation goes to the
replica holding the longest remembered prefix of its prompt when that covers at least MIN_SHARE of it, unless that
replica has more than `imbalance` requests in flight beyond the least busy one's; otherwise (a new prompt, or a
busy holder) to the least busy replica. Calls that carry no prompt (load, info) are spread the same way.

It runs in the caller's process (the ingress), one per deployment handle; with one ingress replica it sees every
request. Its decisions are counted in deploy/metrics.py's ROUTING_DECISIONS, which the ingress's /metrics reports
(through the module: Serve sends the router's class to the ingress by value, so names global here would be copies).
"""
import collections
import random

from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from raymoe.deploy import metrics

BLOCK_TOKENS = 16
MAX_BLOCKS = 1 << 18          # remembered blocks, least recently routed dropped first (~40 MB at most)
IMBALANCE = 4                 # requests in flight beyond the least busy replica's before a prefix is not followed
MIN_SHARE = 0.1               # of the prompt, a prefix must cover to be followed


def block_keys(token_ids: list[int], block: int = BLOCK_TOKENS) -> list[int]:
    """One key per whole block of the prompt; key i stands for tokens [0, (i + 1) * block)."""
    keys, key = [], 0
    for end in range(block, len(token_ids) + 1, block):
        key = hash((key, tuple(token_ids[end - block:end])))
        keys.append(key)
    return keys


def prompt_of(pending_request) -> list[int] | None:
    """The prompt's token ids of a Pipeline.generate call (request_id, request), else None."""
    args = getattr(pending_request, "args", None)
    if args and len(args) == 2 and isinstance(args[1], dict):
        ids = args[1].get("prompt_token_ids")
        return ids if isinstance(ids, list) else None
    return None


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, imbalance: int = IMBALANCE, min_share: float = MIN_SHARE,
                         block_tokens: int = BLOCK_TOKENS, max_blocks: int = MAX_BLOCKS):
        self.imbalance, self.min_share, self.block_tokens, self.max_blocks = (imbalance, min_share, block_tokens,
                                                                              max_blocks)
        self.holder: collections.OrderedDict = collections.OrderedDict()    # block key -> replica id
        self.name = self._deployment_id.name if self._deployment_id else ""

    def _fulfill_next_pending_request(self, replica, request_metadata=None):
        """Serve's, but for a request cancelled while it was routed (its client went away): Serve's own (Ray 2.60)
        sets that request's future all the same, and logs the InvalidStateError with a traceback."""
        find = getattr(self, "_get_pending_request_matching_internal_request_id", None)
        pending = find(request_metadata) if find else None
        if pending is not None and pending.future.done():
            self._remove_pending_request_from_indices(pending)
            return
        super()._fulfill_next_pending_request(replica, request_metadata)

    def _in_flight(self, replica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    def held_prefix(self, keys: list[int], candidates: dict):
        """(the candidate holding the longest remembered prefix, its blocks), or (None, 0)."""
        for depth in range(len(keys), 0, -1):
            replica_id = self.holder.get(keys[depth - 1])
            if replica_id in candidates:
                return candidates[replica_id], depth
        return None, 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        """The one replica for this request (Serve calls again, after a back-off, should it have no room). The
        choice is remembered here: Serve tells a router which replica took a request only when replicas may refuse
        requests, which this app's do not."""
        if not candidate_replicas:
            return []
        least_busy = min(candidate_replicas, key=lambda r: (self._in_flight(r), random.random()))
        ids = prompt_of(pending_request)
        if not ids:
            return [[least_busy]]
        keys = block_keys(ids, self.block_tokens)
        holder, depth = self.held_prefix(keys, {r.replica_id: r for r in candidate_replicas})
        if holder is None or depth * self.block_tokens < self.min_share * len(ids):
            decision, chosen = "new", least_busy
        elif self._in_flight(holder) - self._in_flight(least_busy) > self.imbalance:
            decision, chosen = "balance", least_busy
        else:
            decision, chosen = "prefix", holder
        metrics.ROUTING_DECISIONS[(self.name, decision)] += 1
        for key in keys:
            self.holder[key] = chosen.replica_id
            self.holder.move_to_end(key)
        while len(self.holder) > self.max_blocks:
            self.holder.popitem(last=False)
        return [[chosen]]
