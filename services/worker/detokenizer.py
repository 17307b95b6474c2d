"""Incremental detokenization with stop sequences: text deltas that never split a UTF-8
character and never leak (part of) a stop sequence.

Fast (Rust-backed) tokenizers stream through the tokenizers library's `DecodeStream`, which holds
byte-level BPE pieces that end mid-character until the character completes (~1 µs a token; the
sliding-window decode below took ~7 µs, two full decodes per token on the engine thread). Other
tokenizers decode a sliding window of tokens (prefix/read offsets, as TGI and vLLM do). Text
that might be the start of a stop sequence is held back until it is known not to be one; a
matched stop sequence is cut from the output (OpenAI semantics). Each stop sequence is followed by
a KMP automaton fed the new characters (`StopMatcher`), so matching and the hold-back cost O(new
characters) a token, not O(stop length^2) (8 stops of 256 characters took ~0.6 ms a token).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class StopMatcher:
    """How much of one stop sequence the text ends with (`matched`: the longest prefix of the stop
    that is a suffix of the text fed so far), updated per character with the stop's KMP failure
    function."""

    def __init__(self, stop: str) -> None:
        self.stop, self.matched = stop, 0
        fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self._fail = fail

    def feed(self, c: str) -> bool:
        """One more character; True when the text now ends with the whole stop sequence."""
        stop, k = self.stop, self.matched
        if k == len(stop):
            k = self._fail[k - 1]
        while k and c != stop[k]:
            k = self._fail[k - 1]
        if c == stop[k]:
            k += 1
        self.matched = k
        return k == len(stop)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self._tok = tokenizer
        self._stop = [s for s in (stop or []) if s]
        self._matchers = [StopMatcher(s) for s in self._stop]
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""  # stable text so far (stop sequence removed once matched)
        self._emitted = 0
        self.stopped = False
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=True) if backend is not None else None
        self._backend = backend
        self._streamed = 0  # characters the stream produced (text before any stop cut)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Adds a token; returns the new text safe to stream now ('' if none)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
            if piece:
                self._streamed += len(piece)
                self._append(piece)
            return self._take(final=False)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._append(new_text[len(prefix_text) :])
            self._prefix, self._read = self._read, len(self._ids)
        return self._take(final=False)

    def finish(self) -> str:
        """Flushes what is left (incomplete characters decode as U+FFFD, as a full decode would)."""
        if not self.stopped and self._stream is not None:
            # bytes the stream still holds (an incomplete character): as a full decode ends
            full = self._decode(self._ids)
            if len(full) > self._streamed:
                self._append(full[self._streamed :])
        elif not self.stopped:
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            new_text = self._decode(self._ids[self._prefix :])
            if len(new_text) > len(prefix_text):
                self._append(new_text[len(prefix_text) :])
            self._prefix = self._read = len(self._ids)
        return self._take(final=True)

    def _append(self, piece: str) -> None:
        """Adds text; at the first character that completes a stop sequence the text is cut
        where the longest stop sequence completed by it began."""
        start = len(self.text)
        self.text += piece
        for i, c in enumerate(piece):
            done = [len(m.stop) for m in self._matchers if m.feed(c)]  # every matcher sees c
            if done:
                self.text = self.text[: start + i + 1 - max(done)]
                self.stopped = True
                return

    def _holdback(self) -> int:
        """Characters at the end of the text that may begin a stop sequence."""
        if self.stopped or not self._matchers:
            return 0
        return max(m.matched for m in self._matchers)

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._holdback()
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, used by Qwen2 and Llama 3): each byte as one printable
    character — the printable Latin-1 bytes as themselves, the other bytes in order as U+0100
    onwards — mapped back to the byte."""
    kept = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = {}, 0
    for b in range(256):
        if b in kept:
            out[chr(b)] = b
        else:
            out[chr(0x100 + shifted)] = b
            shifted += 1
    return out


class TokenText:
    """One token's text and exact bytes (log-probabilities name tokens one by one). A byte-level
    BPE piece maps back to its bytes exactly, even one that ends inside a UTF-8 character (its
    text then shows U+FFFD); other tokenizers give the UTF-8 of the token's decoded text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._alphabet = _byte_level_alphabet()
        space = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False))
        self._byte_level = bool(space) and space[0].startswith("\u0120")  # "Ġ": a byte-level space
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        got = self._cache.get(token_id)
        if got is None:
            text = self.tokenizer.decode([token_id])
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if (
                self._byte_level
                and piece is not None
                and all(c in self._alphabet for c in piece)
                and token_id not in self.tokenizer.all_special_ids
            ):
                raw = bytes(self._alphabet[c] for c in piece)
            else:
                raw = text.encode()
            got = self._cache[token_id] = (text, raw)
        return got
