"""Turns one step's logits into tokens: penalties, min_tokens, greedy or temperature/top-k/top-p/
min-p sampling, per-request seeds, logprobs.

Every request's choice depends only on its own logits and parameters: seeded requests draw
their noise from a generator keyed by (seed, number of tokens already generated), so the
same request gives the same tokens alone or in any batch, with no generator state to carry
between steps. Work that only some rows need (penalties, top-k/top-p sorting, logprobs) runs
only when some row asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferlab.engine.outputs import ScheduledRequest
from inferlab.engine.request import Logprob, TokenLogprobs

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> SamplerOutput:
        """logits: float32 [N, V], one row per request in `rows`."""
        want_logprobs = any(r.sampling_params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        if any(r.sampling_params.has_penalties for r in rows):
            logits = apply_penalties(logits.clone(), rows)
        logits = mask_early_stop_tokens(logits, rows)

        params = [r.sampling_params for r in rows]
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, rows)
        token_list = tokens.tolist()
        lp = None
        if raw_logprobs is not None:
            lp = gather_logprobs(raw_logprobs, token_list, rows)
        return SamplerOutput(token_list, lp)

    def _sample(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
        params = [r.sampling_params for r in rows]
        n = len(rows)
        greedy = torch.tensor([p.greedy for p in params])
        temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32)
        argmax = logits.argmax(dim=-1)
        logits = logits / temp.unsqueeze(1)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            mp = torch.tensor(min_p, dtype=torch.float32).unsqueeze(1)
            probs = torch.where(probs < probs.max(dim=-1, keepdim=True).values * mp, 0.0, probs)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            seed = r.sampling_params.seed
            if seed is not None and not params[i].greedy:
                noise[i] = seeded_exponential(seed, len(r.output_token_ids), probs.shape[1])
        sampled = exponential_race(probs, noise)
        return torch.where(greedy, argmax, sampled) if n else sampled


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample from `probs` as argmax(p / E) with E ~ Exp(1): the Gumbel trick without a log,
    and no host sync (unlike torch.multinomial on some backends)."""
    return (probs / noise).argmax(dim=-1)


def seeded_exponential(seed: int, step: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise that depends only on (seed, step): batch-independent and stateless."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.empty(vocab, dtype=torch.float32).exponential_(generator=g)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus (one sort for the batch)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k])
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    p = torch.tensor(top_p, dtype=torch.float32).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, _NEG_INF), dim=-1)
    # Keep a token if the mass before it is < p (so the top token always stays).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= p
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (divides positive logits, multiplies
    negative ones, as in the CTRL paper and Hugging Face); presence and frequency penalties over
    output tokens (OpenAI's definitions)."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        sp = r.sampling_params
        if not sp.has_penalties:
            continue
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(list(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.long)
            if seen.numel():
                vals = logits[i, seen]
                vals = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
                logits[i, seen] = vals
        if (sp.presence_penalty or sp.frequency_penalty) and r.output_token_ids:
            counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
            logits[i] -= sp.frequency_penalty * counts.float() + sp.presence_penalty * (counts > 0).float()
    return logits


def mask_early_stop_tokens(logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
    """While a request has fewer than min_tokens outputs, it may not pick EOS or a stop token."""
    cloned = False
    for i, r in enumerate(rows):
        sp = r.sampling_params
        if sp.min_tokens and len(r.output_token_ids) < sp.min_tokens:
            ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(r.eos_token_ids))
            ids = [t for t in ids if t < logits.shape[1]]
            if ids:
                if not cloned:
                    logits, cloned = logits.clone(), True
                logits[i, ids] = _NEG_INF
    return logits


def gather_logprobs(
    logprobs: torch.Tensor, chosen: list[int], rows: list[ScheduledRequest]
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = []
    for i, r in enumerate(rows):
        k = r.sampling_params.logprobs
        if k is None:
            out.append(None)
            continue
        row = logprobs[i]
        tok = chosen[i]
        val = row[tok]
        rank = int((row > val).sum()) + 1
        top: list[Logprob] = []
        if k > 0:
            v, ids = row.topk(k)
            top = [Logprob(int(t), float(x), j + 1) for j, (t, x) in enumerate(zip(ids.tolist(), v.tolist()))]
        out.append((Logprob(tok, float(val), rank), top))
    return out
