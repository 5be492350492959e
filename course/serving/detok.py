"""Incremental detokenization that never emits broken UTF-8.

A byte-level BPE token can hold part of a multi-byte character: "é" may be two tokens, and
decoding the first one alone gives U+FFFD, the replacement character. Streaming servers
therefore decode a small window of recent tokens, emit only the text that is new *and*
complete, and hold back while the window's text still ends in U+FFFD (the approach of Hugging
Face TGI and vLLM's ``detokenize_incrementally``). Decoding a window that starts a few tokens
back also keeps tokenizers that drop a leading space at the start of a decode (SentencePiece)
from gluing words together.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"
# Tokens of context decoded before the new ones (vLLM uses 5 prompt tokens as well).
CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so a window still ending in U+FFFD after this many held-back
# tokens will never complete: emit it (replacement characters and all) rather than hold back forever,
# which would make every later push decode an ever longer window (quadratic, on the event loop).
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turn a stream of token ids into a stream of valid text deltas.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        prompt_ids: the prompt; its last few tokens give the first output token its context.
        skip_special_tokens: leave special tokens (end-of-sequence, ...) out of the text.

    ``push(token)`` returns the new text (possibly ""), ``flush()`` whatever is still held back
    when the stream ends, and ``text`` everything emitted so far.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = len(self.ids)  # tokens before this are already emitted
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        held = len(self.ids) - self.read_offset
        if len(new_text) > len(prefix_text) and (not new_text.endswith(REPLACEMENT) or held >= MAX_HELD_TOKENS):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """The text still held back (at the end of a stream), even if it is incomplete."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
