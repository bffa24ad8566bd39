"""`--reasoning-parser qwen3`: a thinking model's `<think>...</think>` block into the message's
`reasoning_content` (vLLM's and llama-server's field), the rest into `content`.

An answer that opens with `<think>` is thinking until `</think>` (all of it, if cut short); one
that does not (Qwen3 with `enable_thinking: false`, whose template writes the empty block into
the prompt) is all content, streamed or not. Tool calls are read from the content.
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")  # the same tags
OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    body = text.lstrip()
    if body.startswith(OPEN):
        body = body[len(OPEN) :]
        end = body.find(CLOSE)
        if end < 0:
            return body.strip() or None, ""
        return body[:end].strip() or None, body[end + len(CLOSE) :].lstrip()
    return None, text


class ReasoningStream:
    """One streamed choice: text deltas in, (reasoning delta, content delta) out; a possible
    tag is held back until it is known."""

    def __init__(self) -> None:
        self.state = "start"  # start → thinking → content
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        if self.state == "start":
            body = self.buffer.lstrip()
            if len(body) < len(OPEN) and OPEN.startswith(body):
                return "", ""  # it may still become the tag
            if body.startswith(OPEN):
                self.state, self.buffer = "thinking", body[len(OPEN) :].lstrip()
            else:
                self.state = "content"
        if self.state == "thinking":
            end = self.buffer.find(CLOSE)
            if end >= 0:
                reasoning, rest = self.buffer[:end], self.buffer[end + len(CLOSE) :].lstrip()
                self.state, self.buffer = "content", ""
                return reasoning, rest
            keep = partial_suffix(self.buffer, CLOSE)
            out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
            return out, ""
        out, self.buffer = self.buffer, ""
        return "", out

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.state == "thinking" else ("", rest)


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may be the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
