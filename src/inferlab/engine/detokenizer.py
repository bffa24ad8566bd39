"""Token ids → text as they stream out: UTF-8-safe deltas and stop strings across token borders.

The engine's output processor holds one `IncrementalDetokenizer` per sequence; it decodes a
window of recent tokens (a few prompt tokens for context) so that a character split across
tokens is never emitted half-done, and holds back text that may be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferlab.tokenizer import Tokenizer

# Prompt tokens decoded along with the first output tokens: enough context for decoders whose
# output depends on the previous token (SentencePiece drops a leading space at the start of a
# text) and for a character whose bytes began in the prompt.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerUpdate:
    """What one `update` adds to the output."""

    text_delta: str  # new text safe to show: whole characters, no possible stop-string start
    stop_string: str | None = None  # the stop string just matched; the request should finish


def _partial_stop_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the beginning (not all) of a stop string.

    That much text must be held back: the next tokens might complete the stop string, and
    then it must not have been shown. Cost: O(sum of len(stop)^2) in the worst case, tiny
    for real stop strings; the common case exits on the first character test.
    """
    last = text[-1:]
    best = 0
    for s in stops:
        if not last or last not in s:
            continue
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    """Turns one sequence's new token ids into new text, step by step.

    Decoding is incremental (the prefix-offset / read-offset scheme of TGI and vLLM): only a
    short window of recent tokens is decoded per step, so the cost per step does not grow
    with the length of the output.

        window:  | context (already text) | tokens not yet text |
                 ^ prefix_offset           ^ read_offset           (window starts at prefix_offset)

        text of the new tokens = decode(window)[len(decode(context)):]

    While that ends in U+FFFD the last token stopped in the middle of a UTF-8 character and
    nothing is emitted; the next token completes it. Once text is emitted the window slides:
    the tokens just turned into text become the new context.

    Stop strings are matched on text, so they are found across token borders. Text that could
    still turn out to be the start of a stop string is held back until it no longer can.

    Call `update` with each step's new tokens; when the request ends for any reason other
    than a stop string found here (EOS, stop token, length, abort), call `finalize` to flush.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.backend
        self._skip_special = skip_special_tokens
        self._stops = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._window: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read = len(self._window)  # window[:read] is context whose text is known
        self._context_text: str | None = None  # decode(window[:read]), computed when needed
        self._held = ""  # decoded text kept back because it may begin a stop string
        self.text = ""  # everything emitted so far
        self.stop_string: str | None = None  # the stop string that ended the output, if any
        self.finished = False

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> DetokenizerUpdate:
        """Add one step's tokens; return the text that is now safe to show.

        `stop_terminated`: the last of `new_token_ids` is the EOS or stop token that ended the
        request; its text is left out unless include_stop_str_in_output (vLLM's rule). The
        caller still calls `finalize` afterwards.
        """
        if self.finished:
            return DetokenizerUpdate("")
        if stop_terminated and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        if not new_token_ids:
            return DetokenizerUpdate("")
        return self._emit(self._decode_new(new_token_ids, flush=False))

    def finalize(self) -> str:
        """Flush at the end of the request: the tokens still undecoded (even an incomplete
        character, as U+FFFD, since nothing can complete it now) and any held-back text.
        Returns that last piece of text; a stop string found in it is still honoured."""
        if self.finished:
            return ""
        tail = self._decode_new((), flush=True)
        self._held, buf = "", self._held + tail
        delta, self.stop_string = self._cut_at_stop(buf)
        if self.stop_string is None:
            delta = buf
        self.text += delta
        self.finished = True
        return delta

    def _decode_new(self, new_token_ids: Sequence[int], flush: bool) -> str:
        """New complete text from the window; "" while the last character is incomplete."""
        window = self._window
        window.extend(new_token_ids)
        if len(window) == self._read:
            return ""
        decode = self._backend.decode
        if self._context_text is None:
            self._context_text = decode(window[: self._read], skip_special_tokens=self._skip_special)
        full = decode(window, skip_special_tokens=self._skip_special)
        n_context = len(self._context_text)
        if not flush and (len(full) <= n_context or full.endswith(_REPLACEMENT_CHAR)):
            return ""  # an incomplete character (or only skipped special tokens): wait
        # Slide: the tokens just decoded become the context of the next step.
        del window[: self._read]
        self._read = len(window)
        self._context_text = None
        return full[n_context:]

    def _emit(self, new_text: str) -> DetokenizerUpdate:
        if not new_text:
            return DetokenizerUpdate("")
        if not self._stops:
            self.text += new_text
            return DetokenizerUpdate(new_text)
        # Only held text and new text can contain the start of a match: emitted text never
        # contains the beginning of a stop string, by construction.
        buf = self._held + new_text
        delta, stop = self._cut_at_stop(buf)
        if stop is not None:
            self._held = ""
            self.text += delta
            self.stop_string = stop
            self.finished = True
            return DetokenizerUpdate(delta, stop)
        keep = _partial_stop_suffix_len(buf, self._stops)
        delta, self._held = (buf[:-keep], buf[-keep:]) if keep else (buf, "")
        self.text += delta
        return DetokenizerUpdate(delta)

    def _cut_at_stop(self, buf: str) -> tuple[str, str | None]:
        """(text up to the earliest stop string, that stop string), or ("", None) if none."""
        best_at, best = -1, None
        for s in self._stops:
            at = buf.find(s)
            if at != -1 and (best is None or at < best_at):
                best_at, best = at, s
        if best is None:
            return "", None
        end = best_at + (len(best) if self._include_stop else 0)
        return buf[:end], best
