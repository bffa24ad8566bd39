"""What one benchmark request did, as the client saw it: the record every other bench module reads.

Timing definitions live here, next to the data, so that there is exactly one of each
(vLLM's, which inference-perf shares; GuideLLM and AIPerf call our TPOT "ITL"):

    send ──── first content chunk ──── chunk ── chunk ── ... ── last chunk ── [DONE]
     │◄── TTFT ──►│                     │◄ITL►│                               │
     │◄────────────────────────── E2E ──────────────────────────────────────────►│

- TTFT: send → the first chunk that carries text.
- ITL: every gap between successive content chunks; a chunk that carries k tokens
  contributes k gaps of (gap / k), so the pooled list is per token.
- TPOT: (E2E − TTFT) / (output tokens − 1), only for requests with more than one token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(str, enum.Enum):
    """How a request ended; each kind is counted on its own, none is dropped."""

    OK = "ok"  # 200, content, then [DONE]
    FAILED = "failed"  # non-200, a `data: {"error": ...}` event, no content, or no connection
    INCOMPLETE = "incomplete"  # a 200 stream that ended (or broke) before [DONE]
    TIMEOUT = "timeout"  # no complete answer within the client's --timeout


@dataclass
class RequestRecord:
    """One request's timeline and token counts. Times are `time.perf_counter()` seconds."""

    index: int  # position in the dataset (send order)
    status: RequestStatus = RequestStatus.OK
    error: str = ""  # one line saying what went wrong ("" when OK)
    http_status: int | None = None  # None when no response arrived
    send_time: float = 0.0  # just before the HTTP request went out
    end_time: float = 0.0  # [DONE] arrived, or the moment the request was given up
    # Arrival time of every chunk that carried text, and how many tokens each carried
    # (1 unless the server said more through `continuous_usage_stats`).
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens, else the dataset's count
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache (when it says)
    output_tokens: int | None = None  # usage.completion_tokens; filled in after the run when absent
    output_tokens_source: str = ""  # "usage" | "tokenizer" | "chunks"
    text: str = ""  # the generated text (kept for token counting, not written to reports)

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.OK

    @property
    def ttft(self) -> float | None:
        """Send → first content chunk, seconds; None when no content arrived."""
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float:
        """Send → end of the response ([DONE]), seconds."""
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        """Per-token gaps between successive content chunks (vLLM's ITL), seconds."""
        gaps: list[float] = []
        for j in range(1, len(self.chunk_times)):
            gap = self.chunk_times[j] - self.chunk_times[j - 1]
            k = max(1, self.chunk_tokens[j] if j < len(self.chunk_tokens) else 1)
            gaps.extend([gap / k] * k)
        return gaps

    @property
    def tpot(self) -> float | None:
        """(E2E − TTFT) / (output tokens − 1), seconds; None with one token or fewer."""
        ttft = self.ttft
        if ttft is None or self.output_tokens is None or self.output_tokens <= 1:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)
