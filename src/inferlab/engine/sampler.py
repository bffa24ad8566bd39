"""Turns one step's logits into tokens: logit bias and allowed tokens, grammar masks (structured
outputs), penalties, min_tokens, greedy or temperature/top-k/top-p/min-p sampling, per-request
seeds, logprobs.

Sampling is by inverse CDF: one uniform per row picks the token whose share of the running sum
it falls in (noise for every token of a 49,152-token vocabulary made a 32-row step's sampling
51 ms instead of 6 on a CPU), and top-k / top-p narrow the row to a few hundred candidates
first instead of sorting it whole. Every request's choice depends only on its own logits and
parameters: a seeded request draws its uniform from a generator keyed by (seed, number of
tokens already generated), so the same request gives the same tokens alone or in any batch,
with no generator state to carry between steps. Work that only some rows need (penalties,
top-k/top-p sorting, logprobs) runs only when some row asks for it.

Where the CPU kernels are built, greedy / temperature / top-k / top-p / min-p run as one call
(kernels/csrc/sampler.cpp, the same definition row by row): the torch version below is ~25
batched operators, ~14 ms of a 32-row decode step with llama.cpp's defaults on one core. The torch
version stays the definition, the fallback, and what the tests compare the kernel with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferlab.engine.outputs import ScheduledRequest
from inferlab.engine.request import Logprob, SamplingParams, TokenLogprobs
from inferlab.engine.structured_outputs import GrammarMasker

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked


class Sampler:
    """`fused`: draw through the one-call kernel (decided once by the runner: CPU logits and the
    kernels built); else the torch operators."""

    def __init__(self, seed: int = 0, fused: bool = False):
        self.generator = torch.Generator().manual_seed(seed)
        self.fused = fused
        # The fused kernel's per-row parameter tensors, kept while the rows' values stay the same
        # (a decode batch keeps its requests for many steps): building them was 4 of the ~8 tensor
        # constructions of a one-stream decode step, ~25 us of its ~280 us of Python.
        self._row_params: tuple[tuple, tuple[torch.Tensor, ...]] | None = None
        self.grammar_masks = GrammarMasker(kernel=fused)  # fused: our CPU kernels run here

    def __call__(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> SamplerOutput:
        """logits: float32 [N, V], one row per request in `rows`. The rows of requests with a
        grammar come back masked: the mask is applied in place, not to a copy of the batch."""
        want_logprobs = any(r.sampling_params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        grammar_rows = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
        if grammar_rows:  # structured outputs: what the grammar forbids, before everything else,
            # in place, so that `probs` (rejection sampling) sees it too. A request with drafts
            # has a row per draft position (spec_decode.position_rows), its depth-0 row first.
            drafts = [rows[i].draft_token_ids if rows[i].draft_depth == 0 else () for i in grammar_rows]
            self.grammar_masks(logits, grammar_rows, [rows[i].grammar for i in grammar_rows],
                               drafts if any(drafts) else None)
        logits = adjust_logits(logits, rows)

        params = [r.sampling_params for r in rows]
        if self.fused:
            tokens = self._sample_fused(logits, rows, params)
        elif all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, rows, params)
        token_list = tokens.tolist()
        lp = None
        if raw_logprobs is not None:
            lp = gather_logprobs(raw_logprobs, token_list, rows)
        return SamplerOutput(token_list, lp)

    def probs(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
        """The distribution each row's token is sampled from, [N, V] float32: logit bias and
        allowed tokens, penalties, min_tokens, temperature, top-k/top-p (`apply_top_k_top_p`,
        the definition `sample_truncated` follows), min-p; one-hot at the argmax for greedy
        rows. Rejection sampling against a draft distribution needs p itself, not a sample."""
        logits = adjust_logits(logits, rows)
        params = [r.sampling_params for r in rows]
        temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32)
        scaled = logits / temp.unsqueeze(1)
        if any(0 < p.top_k < logits.shape[1] for p in params) or any(p.top_p < 1.0 for p in params):
            scaled = apply_top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params])
        probs = torch.softmax(scaled, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).unsqueeze(1)
        if bool((min_p > 0).any()):
            probs = apply_min_p(probs, probs.max(dim=-1, keepdim=True).values, min_p)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            idx = torch.tensor(greedy)
            probs[idx] = torch.nn.functional.one_hot(logits[idx].argmax(dim=-1), logits.shape[1]).to(probs.dtype)
        return probs

    def uniforms(self, rows: list[ScheduledRequest], stream: int) -> torch.Tensor:
        """One U[0, 1) per row for a purpose `stream` (1: a draft model's draw, 2: accepting a
        draft, 3: the residual's draw): a seeded request's from (seed, tokens generated so far,
        stream), so rejection sampling is as reproducible as sampling; else the sampler's."""
        u = torch.rand(len(rows), dtype=torch.float64, generator=self.generator)
        for i, r in enumerate(rows):
            seed = r.sampling_params.seed
            if seed is not None:
                key = (seed * 1_000_003 + len(r.output_token_ids)) * 7 + stream
                g = torch.Generator().manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)
                u[i] = torch.rand(1, dtype=torch.float64, generator=g)
        return u

    def _sample(self, logits: torch.Tensor, rows: list[ScheduledRequest], params: list[SamplingParams]) -> torch.Tensor:
        greedy = torch.tensor([p.greedy for p in params])
        temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32)
        argmax = logits.argmax(dim=-1)
        logits = logits / temp.unsqueeze(1)
        u = self._uniforms(rows)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).unsqueeze(1)
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sampled = sample_truncated(logits, top_k, top_p, min_p, u)
        else:
            sampled = sample_softmax(logits, min_p, u)
        return torch.where(greedy, argmax, sampled)

    def _sample_fused(self, logits: torch.Tensor, rows: list[ScheduledRequest],
                      params: list[SamplingParams]) -> torch.Tensor:
        """`_sample`'s distribution (argmax for greedy rows) in one kernel call; the uniforms are
        drawn as `_sample` draws them, so a seeded request gets the same tokens either way."""
        key = tuple((p.temperature, p.top_k, p.top_p, p.min_p) for p in params)
        if self._row_params is None or self._row_params[0] != key:
            temp, top_k, top_p, min_p = zip(*key) if key else ((),) * 4
            self._row_params = (key, (torch.tensor(temp, dtype=torch.float32), torch.tensor(top_k, dtype=torch.long),
                                      torch.tensor(top_p, dtype=torch.float32), torch.tensor(min_p, dtype=torch.float32),
                                      torch.zeros(len(rows), dtype=torch.float64)))
        temp_t, top_k_t, top_p_t, min_p_t, zeros = self._row_params[1]
        u = zeros if all(p.greedy for p in params) else self._uniforms(rows)
        return torch.ops.inferlab.sample_rows(logits, temp_t, top_k_t, top_p_t, min_p_t, u)

    def _uniforms(self, rows: list[ScheduledRequest]) -> torch.Tensor:
        """One U[0, 1) draw per row: a seeded request's from (seed, tokens generated so
        far) alone, so it does not depend on the batch; the others' from the sampler's generator."""
        u = torch.rand(len(rows), dtype=torch.float64, generator=self.generator)
        for i, r in enumerate(rows):
            seed = r.sampling_params.seed
            if seed is not None:
                g = torch.Generator().manual_seed((seed * 1_000_003 + len(r.output_token_ids)) & 0x7FFF_FFFF_FFFF_FFFF)
                u[i] = torch.rand(1, dtype=torch.float64, generator=g)
        return u


# top-k / top-p rows are first narrowed to this many highest logits (one partial sort instead of
# a full sort of the vocabulary: at 32 rows x 49,152 tokens the whole sampler took 6 ms against
# 131 ms). A row whose nucleus reaches past them (a very flat distribution) is redone over its
# whole vocabulary.
CANDIDATES = 256


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's index j with probability weights[i, j] / sum(weights[i]) (weights >= 0, not
    normalised): the first j whose running sum exceeds u[i] times the total. One pass over the
    row and one uniform per row (noise for every token made the whole sampler ~8x slower)."""
    cdf = weights.float().cumsum(dim=-1)  # float32: a float64 cumsum here is ~14x slower
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to the total itself: take the last index with weight instead.
    past = idx >= weights.shape[1]
    if bool(past.any()):
        last = weights.shape[1] - 1 - (weights.flip(-1) > 0).int().argmax(dim=-1)
        idx = torch.where(past, last, idx)
    return idx


def apply_min_p(probs: torch.Tensor, top: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one (`top`, [N, 1])."""
    return torch.where(probs < top * min_p, 0.0, probs)


def sample_softmax(logits: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample each row from softmax(logits) (then min-p) with its uniform u."""
    probs = torch.softmax(logits, dim=-1)
    if bool((min_p > 0).any()):
        probs = apply_min_p(probs, probs.max(dim=-1, keepdim=True).values, min_p)
    return inverse_cdf(probs, u)


def _top_k_limits(top_k: list[int], vocab: int) -> torch.Tensor:
    """Each row's top-k as a rank limit: k, or the whole vocabulary for 0 (off) or k >= vocab."""
    return torch.tensor([k if 0 < k < vocab else vocab for k in top_k])


def sample_truncated(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Sample each row from its top-k, then top-p nucleus (then min-p), as `apply_top_k_top_p`
    defines them, working on the CANDIDATES highest logits (or each row's top-k, if larger)."""
    n, vocab = logits.shape
    k_eff = _top_k_limits(top_k, vocab)
    kc = min(vocab, max([CANDIDATES] + [k for k in top_k if 0 < k < vocab]))
    vals, ids = logits.topk(kc, dim=-1)  # sorted, highest first
    drop = torch.arange(kc).unsqueeze(0) >= k_eff.unsqueeze(1)
    # A top-k row is normalised over its top-k (all among the candidates); any other row over
    # its whole vocabulary.
    limited = (k_eff < vocab) | (kc == vocab)
    lse = torch.logsumexp(vals.masked_fill(drop, _NEG_INF), dim=-1)
    if not bool(limited.all()):
        lse = torch.where(limited, lse, torch.logsumexp(logits, dim=-1))
    probs = torch.exp(vals - lse.unsqueeze(1)).masked_fill(drop, 0.0)
    p = torch.tensor(top_p, dtype=torch.float32).unsqueeze(1)
    # The nucleus of an unlimited row may go past the candidates: it keeps every candidate
    # (each one's preceding mass is < p) and more.
    beyond = ~limited & (probs.sum(dim=-1) < p.squeeze(1))
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before >= p, 0.0)
    if bool((min_p > 0).any()):
        probs = apply_min_p(probs, probs[:, :1], min_p)
    sampled = ids.gather(1, inverse_cdf(probs, u).unsqueeze(1)).squeeze(1)
    if bool(beyond.any()):
        rows = beyond.nonzero().squeeze(1)
        masked = apply_top_k_top_p(logits[rows], [top_k[i] for i in rows.tolist()], [top_p[i] for i in rows.tolist()])
        sampled[rows] = sample_softmax(masked, min_p[rows], u[rows])
    return sampled


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus (one sort for the batch):
    the definition `sample_truncated` follows, and its fallback for rows it cannot narrow."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = _top_k_limits(top_k, vocab)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    p = torch.tensor(top_p, dtype=torch.float32).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, _NEG_INF), dim=-1)
    # Keep a token if the mass before it is < p (so the top token always stays).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= p
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_token_constraints(logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
    """allowed_token_ids (every other token -inf) and logit_bias (added), in place, before
    penalties and temperature as vLLM orders them: one scatter for the batch each, the Python
    loop over the requests' listed tokens only, never over the vocabulary."""
    vocab = logits.shape[1]
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    allow_rows: list[int] = []  # rows restricted, in order
    allow_local: list[int] = []  # index into allow_rows, per allowed token
    allow_cols: list[int] = []
    for i, r in enumerate(rows):
        sp = r.sampling_params
        if sp.allowed_token_ids is not None:
            allow_local.extend([len(allow_rows)] * len(sp.allowed_token_ids))
            allow_rows.append(i)
            allow_cols.extend(sp.allowed_token_ids)
        if sp.logit_bias:
            bias_rows.extend([i] * len(sp.logit_bias))
            bias_cols.extend(sp.logit_bias)
            bias_vals.extend(sp.logit_bias.values())
    if allow_rows:
        mask = torch.full((len(allow_rows), vocab), _NEG_INF, dtype=logits.dtype)
        mask[torch.tensor(allow_local), torch.tensor(allow_cols)] = 0.0
        idx = torch.tensor(allow_rows)
        logits[idx] = logits[idx] + mask
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows), torch.tensor(bias_cols)),
                          torch.tensor(bias_vals, dtype=logits.dtype), accumulate=True)
    return logits


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


def adjust_logits(logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
    """What every request's own fields do to its logits before sampling (`Sampler.__call__`)
    and before its distribution is taken (`Sampler.probs`): logit bias / allowed tokens,
    penalties, min_tokens; a copy where anything changes, `logits` itself where nothing does."""
    if any(r.sampling_params.has_token_constraints for r in rows):
        logits = apply_token_constraints(logits.clone(), rows)
    if any(r.sampling_params.has_penalties for r in rows):
        logits = apply_penalties(logits.clone(), rows)
    return mask_early_stop_tokens(logits, rows)


def plain_greedy(rows: list[ScheduledRequest]) -> bool:
    """Every row's token is the argmax of its raw logits: greedy, no logprobs, no grammar, and
    nothing `adjust_logits` changes (no logit bias or allowed tokens, no penalties, min_tokens
    met). Such a step needs each row's argmax only, not its logits (ModelRunner.execute)."""
    for r in rows:
        p = r.sampling_params
        if (not p.greedy or p.logprobs is not None or p.has_token_constraints or p.has_penalties
                or getattr(r, "grammar", None) is not None or _before_min_tokens(r)):
            return False
    return True


def _before_min_tokens(r: ScheduledRequest) -> bool:
    """Fewer than min_tokens outputs yet: EOS and the stop tokens are still masked."""
    return bool(r.sampling_params.min_tokens) and len(r.output_token_ids) < r.sampling_params.min_tokens


def mask_early_stop_tokens(logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
    """While a request has fewer than min_tokens outputs, it may not pick EOS or a stop token."""
    cloned = False
    for i, r in enumerate(rows):
        sp = r.sampling_params
        if _before_min_tokens(r):
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
