"""The sampler: per-sequence draws on the last pipeline stage (the parameters: stages/text/sampling_params.py).

The last pipeline stage samples (sample_chunks). Each draw is a function of the sequence's seed
and the token's position (uniform), so a seeded request draws the same tokens whatever else shares
its batch and whichever PP degree, expert placement or transport runs it. Logprobs are the log-softmax of the raw logits (before
logit_bias, penalties, temperature, top-k, min-p or top-p: vLLM's default).

Before temperature, a row's logits may be adjusted (adjust_logits, in vLLM's order): logit_bias
added, then the repetition penalty on every token seen in the prompt or the output, then the
frequency and presence penalties from the output's token counts. The sequence's history travels
with its ChunkSampling (only when a penalty is set), so the last stage keeps no state of its own and
a restarted stage samples the same. A grammar (structured outputs, stages/text/structured.py) then leaves
only the tokens it allows: its matcher lives on the last stage but is rebuilt from the same history
whenever it is not in step with it. After temperature and top-k, min_p drops the tokens whose
probability is below min_p times the best token's; then top-p. Greedy (temperature 0) takes the
argmax of the adjusted row.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from raymoe.kernels.linear import take_rows
from raymoe.stages.text.sampling_params import MIN_TEMPERATURE, NUCLEUS_GUESSES, SamplingParams

log = logging.getLogger("raymoe.sampling")


def logprob_entry(logprobs: torch.Tensor, token: int, k: int) -> dict:
    """{"token_id", "logprob", "top": [[id, logprob], ...]} with the k best alternatives."""
    top = []
    if k:
        values, ids = torch.topk(logprobs, k)
        top = [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist())]
    return {"token_id": int(token), "logprob": float(logprobs[token]), "top": top}


MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int) -> float:
    """The random number in [0, 1) of a sequence's token `position`: a counter-based stream (splitmix64
    of seed and position), so that whichever stage samples, after whatever restart, the same seed
    draws the same value for the same position."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 11) / 2.0 ** 53


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with n choices: the request's own for the first (so n=1 and
    choice 0 agree), a splitmix64 mix of (seed, index) for the others, in [0, 2**63)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 1


def adjust_logits(logits: torch.Tensor, p: SamplingParams, output_ids=(), prompt_ids=()) -> torch.Tensor:
    """A float32 row [V] with the request's logit_bias and penalties applied (a new tensor), in vLLM's order:
    the bias added; then every token in prompt_ids or output_ids divided by repetition_penalty where its
    logit is positive and multiplied by it where not; then frequency_penalty times the token's count in
    output_ids and presence_penalty (once) subtracted for every token of output_ids. Values stay finite."""
    row = logits.clone()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
    if p.repetition_penalty != 1 and (len(output_ids) or len(prompt_ids)):
        seen = torch.unique(torch.tensor([*prompt_ids, *output_ids], dtype=torch.long))
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and len(output_ids):
        ids, counts = torch.unique(torch.tensor(list(output_ids), dtype=torch.long), return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    # a huge logit times a penalty may leave float32: keep the row finite (softmax of +-inf is NaN)
    limit = torch.finfo(row.dtype).max
    return row.clamp_(-limit, limit)


def sample_token(logits: torch.Tensor, p: SamplingParams, seed: int, position: int) -> int:
    """One token from a float32 logits row [V] (already adjusted, see adjust_logits): greedy below
    MIN_TEMPERATURE, else temperature, top-k, min-p and top-p, then the token where uniform(seed, position)
    falls in the cumulative distribution."""
    if p.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    return draw(token_probs(logits, p), uniform(seed, position))


def token_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from (temperature > 0): temperature, top-k, min-p, top-p."""
    # relative to the best logit, so the scaled values are <= 0 and never overflow to +inf
    scaled = (logits - logits.max()) / p.temperature
    if p.top_k > 0 and p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.min_p > 0:
        # the best token's probability is the largest: relative to it (and renormalised, for top-p)
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
        probs = probs / probs.sum()
    if p.top_p < 1:
        # the nucleus usually lies within the few hundred best tokens: sort those, not a 248k vocabulary
        for k in NUCLEUS_GUESSES:
            sorted_probs, order = torch.topk(probs, min(k, probs.shape[0]))
            if k >= probs.shape[0] or sorted_probs.sum() >= p.top_p:
                break
        else:
            sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False            # a top_p that is 0 in float32 (5e-324) still keeps the best token
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def draw(probs: torch.Tensor, u: float) -> int:
    """The token where u in [0, 1) falls in the cumulative distribution of probs (not necessarily normalised)."""
    cdf = probs.double().cumsum(0)
    token = int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True))
    # the product can round up to the total: then the last token that has any probability
    return token if token < len(cdf) else int(probs.nonzero()[-1])


@dataclass
class ChunkSampling:
    """What the last stage does with one chunk's logits (Sequence.sampling builds it). `targets` are the
    prompt tokens whose logprobs are wanted, predicted by the logit rows from `first`; `tip` is the logit row
    of the chunk's last token when a new token follows it (else None)."""
    first: int = 0
    targets: list[int] = field(default_factory=list)
    prompt_k: int = 0
    tip: int | None = None
    params: SamplingParams | None = None
    seed: int = 0
    position: int = 0              # how many tokens the sequence has generated before this one
    seq_id: int = 0                # whose grammar matcher (stages/text/structured.py Matchers) to use
    # what the penalties and a grammar need (only set when the params have one, and a token is sampled):
    # the tokens generated so far, and (repetition_penalty) the prompt's distinct tokens
    output_ids: list[int] | None = None
    prompt_ids: list[int] | None = None
    # a verify chunk (speculative decoding): the drafts that follow the tip's token, their logits the rows after
    # the tip's; the result holds the drafts the model keeps and one token of its own (verify_chunk)
    drafts: list[int] | None = None
    # drafts the last stage's MTP head proposes after this chunk's token (stages/runtime/mtp.py); they come back
    # as a fourth item of the chunk's result
    mtp: int = 0


def sample_chunks(logits: torch.Tensor, chunks: list[ChunkSampling], matchers=None) -> list:
    """Per chunk (token or None, its logprob entry or None, [prompt logprob entries]), or a one-line error
    message when that chunk's sampling raised (a bug or bad numbers: its sequence alone fails, the step
    does not). Greedy chunks without logprobs (the common case) share one argmax over their rows, on the
    logits' device (a GPU's: only the token ids come to the host); the others sample on the host.
    `matchers` (stages.text.structured.Matchers) gives the masks of the chunks with a grammar, all at once."""
    plain = [c.tip for c in chunks if c.tip is not None and c.params.temperature < MIN_TEMPERATURE
             and c.params.logprobs is None and not c.params.adjusts_logits and c.params.grammar is None
             and not c.drafts]
    # a decode step's rows are all of the logits' rows: no copy of them (1 MB a row at 248k tokens)
    best = dict(zip(plain, torch.argmax(take_rows(logits, plain), -1).tolist())) if plain else {}
    if logits.device.type != "cpu" and any((c.tip is not None and c.tip not in best) or c.targets or c.drafts
                                           for c in chunks):
        logits = logits.cpu()       # the rest samples on the host (its generators are the CPU's)
    constrained = [c for c in chunks if c.tip is not None and c.params.grammar is not None]
    masks = matchers.masks([(c.seq_id, c.params.grammar, c.output_ids or []) for c in constrained]) \
        if constrained else []
    allowed = {id(c): mask for c, mask in zip(constrained, masks)}
    out = []
    for c in chunks:
        try:
            if c.drafts:
                out.append(verify_chunk(logits, c))
            else:
                out.append((best[c.tip], None, []) if c.tip in best and not c.targets
                           else _sample_chunk(logits, c, allowed.get(id(c))))
        except Exception as e:
            log.exception("sampling failed (seed %s, position %s)", c.seed, c.position)
            out.append(f"{type(e).__name__}: {e}")
    return out


def _sample_chunk(logits: torch.Tensor, c: ChunkSampling, allowed=None) -> tuple:
    """`allowed`: with a grammar, the mask of the tokens it allows (or why there is none)."""
    prompt = []
    if c.targets:
        rows = torch.log_softmax(logits[c.first:c.first + len(c.targets)], -1)
        prompt = [logprob_entry(rows[r], t, c.prompt_k) for r, t in enumerate(c.targets)]
    token = entry = None
    if c.tip is not None:
        row = logits[c.tip]
        adjusted = row
        if c.params.adjusts_logits:
            adjusted = adjust_logits(row, c.params, c.output_ids or (), c.prompt_ids or ())
        if c.params.grammar is not None:
            if isinstance(allowed, str):
                raise RuntimeError(allowed)
            adjusted = adjusted.masked_fill(~allowed, float("-inf"))
        token = sample_token(adjusted, c.params, c.seed, c.position)
        if c.params.logprobs is not None:        # of the raw logits (module doc)
            entry = logprob_entry(torch.log_softmax(row, -1), token, c.params.logprobs)
    return token, entry, prompt


def verify_chunk(logits: torch.Tensor, c: ChunkSampling) -> tuple:
    """A verify chunk's result: ([the drafts kept, then the model's own token], their logprob entries or None, []).
    Row j of its logits (from the tip) predicts the token after draft j (the tip's token for j = 0). Each row's token
    is the sequence's own draw at that position (sample_token: the argmax when greedy, else the token where
    uniform(seed, position) falls in the row's distribution P), and a draft is kept while it is that token. The rows
    have the decode steps' bits, so the tokens are those decoding without drafts gives, sampled ones included: a
    seeded request's output does not change. A sampled draft d is kept with probability P(d), as speculative
    rejection sampling keeps a draft proposed for sure, and every token is drawn from P. Its parameters have no
    history (no penalty or grammar: such sequences do not draft)."""
    p, drafts = c.params, c.drafts
    tokens, entries = [], [] if p.logprobs is not None else None
    for j in range(len(drafts) + 1):
        row = logits[c.tip + j]
        adjusted = adjust_logits(row, p) if p.adjusts_logits else row
        token = sample_token(adjusted, p, c.seed, c.position + j)
        tokens.append(token)
        if entries is not None:
            entries.append(logprob_entry(torch.log_softmax(row, -1), token, p.logprobs))
        if j == len(drafts) or token != drafts[j]:
            break
    return tokens, entries, []
