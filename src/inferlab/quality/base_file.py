"""The KL-divergence base file: a base model's distribution over the scored tokens of a text.

Our own format, a safetensors file. Its header names what the numbers belong to (vocabulary
size, n_ctx, chunk count, the sha256 of the evaluated token ids, the model), so a run with
another model, tokenizer, text or context is refused instead of compared. Per scored token it
keeps the top-K log-probs (ids + float32 values), the log of the mass outside them and the
actual token's logprob, not whole rows: a float16 row of a 49,152-token vocabulary is 98 KB,
1.4 GB for this benchmark's 14,535 scored tokens and ~10 GB for 100 k (llama.cpp's own file,
uint16-quantized whole rows, is as large). K = 1024 is 8 KB per token; on SmolLM2's flat
distributions its rest bin reads the mean KLD 2.2% low (Q4_0 vs F16), K = 4096 0.5% low at
32 KB (benchmarks/results/perplexity.md).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inferlab.quality.kld import BaseRows

FORMAT = "inferlab.kld-base/1"


def tokens_sha256(chunks: list[list[int]]) -> str:
    return hashlib.sha256(np.asarray(chunks, dtype="<i4").tobytes()).hexdigest()


@dataclass(frozen=True)
class BaseIdentity:
    """What a base distribution was computed on; must match the run that reads it."""

    vocab_size: int
    n_ctx: int
    n_chunks: int
    tokens_sha256: str
    model: str = ""

    def mismatches(self, other: BaseIdentity) -> list[str]:
        out = []
        if self.vocab_size != other.vocab_size:
            out.append(f"vocab size {other.vocab_size} in the base, {self.vocab_size} here")
        if self.n_ctx != other.n_ctx:
            out.append(f"n_ctx {other.n_ctx} in the base, {self.n_ctx} here (-c)")
        if self.n_chunks != other.n_chunks:
            out.append(f"{other.n_chunks} chunks in the base, {self.n_chunks} here (--chunks, text length)")
        if self.tokens_sha256 != other.tokens_sha256:
            out.append(f"token ids hash {other.tokens_sha256[:12]} in the base, {self.tokens_sha256[:12]} here "
                       "(another text or tokenizer)")
        return out


def save_base(path: str | Path, identity: BaseIdentity, rows: BaseRows, top_k: int) -> None:
    from safetensors.numpy import save_file

    meta = {"format": FORMAT, "identity": json.dumps(identity.__dict__), "top_k": str(top_k)}
    tensors = {"top_ids": rows.top_ids, "top_logprobs": rows.top_logprobs, "rest_logprob": rows.rest_logprob,
               "nll": rows.nll}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=meta)


def load_base(path: str | Path, expected: BaseIdentity) -> BaseRows:
    """Read a base file; ValueError naming every mismatch when it was made for another run."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no KL-divergence base file {path}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not an inferlab KL-divergence base file (format {meta.get('format')!r})")
            have = BaseIdentity(**json.loads(meta["identity"]))
            wrong = expected.mismatches(have)
            if wrong:
                raise ValueError(f"{path} was computed for another model, tokenizer or text: " + "; ".join(wrong))
            return BaseRows(*(f.get_tensor(k) for k in ("top_ids", "top_logprobs", "rest_logprob", "nll")))
    except (OSError, KeyError, TypeError, json.JSONDecodeError, SafetensorError) as e:
        raise ValueError(f"{path} cannot be read as a KL-divergence base file: {e}") from None
