"""The running requests' KV cache: one cache for all rows (nano-vllm's block manager and model
runner state, for a cache without blocks). The cache is the runner's (:mod:`course.serving.runner`):
a ``transformers`` dynamic cache or the lean runner's :class:`~course.serving.runner.KVCache`; both
hold ``layers[i].keys`` and ``.values``.

Its tensors are ``(rows, kv_heads, T, head_dim)``. A row shorter than ``T`` is padded on the
*left*; an attention mask hides the padding and explicit position ids give every token its true
position, so each row computes exactly what it would compute alone (up to float rounding;
``tests/test_serving_engine.py`` checks batched greedy output against one-at-a-time greedy output in
float64). Rows join by concatenation along the batch dimension and leave by index selection;
columns that are padding in every row are trimmed away. A join or a leave copies the cache once
(about what ``transformers``' dynamic cache copies at every step, since it appends with ``torch.cat``);
for the lean runner's cache the join leaves room to grow, so the next decode steps append in place.
"""

from __future__ import annotations

from typing import Any


class BatchCache:
    """Rows of the batch (``rows[i]`` is the request in cache row ``i``) and their cache tensors.

    Args:
        device: where the tensors live.
        mask_4d: pass a ready ``(rows, 1, 1, T + 1)`` boolean mask (SDPA attention: transformers
            then skips building its own mask each step) rather than a 2D one.
    """

    def __init__(self, device: Any, mask_4d: bool) -> None:
        self.device = device
        self.mask_4d = mask_4d
        self.rows: list = []
        self.cache = None  # the runner's cache, left-padded to a common length
        self.lengths = None  # (rows,) real tokens held per row
        self.next = None  # (rows, 1) the token each row feeds into the next step
        self.padded = False  # any row shorter than the cache?

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return 0 if self.cache is None else int(self.cache.layers[0].keys.shape[-2])

    def tokens_held(self) -> int:
        """Token slots held (rows x padded length); 0 when empty."""
        return len(self.rows) * self.width if self.cache is not None else 0

    def decode_inputs(self) -> tuple[Any, dict]:
        """(input ids (rows, 1), forward kwargs) for one decode step of every row."""
        import torch

        kwargs = {}
        if self.padded:
            columns = torch.arange(self.width + 1, device=self.lengths.device).unsqueeze(0)
            visible = columns >= (self.width - self.lengths).unsqueeze(1)  # (rows, width + 1): not padding
            kwargs["attention_mask"] = visible[:, None, None, :] if self.mask_4d else visible.long()
            kwargs["position_ids"] = self.lengths.unsqueeze(1)
        return self.next, kwargs

    def advance(self, cache, tokens) -> None:
        """After a decode step: the grown cache, and each row's next input token (a list of ints,
        or already a ``(rows, 1)`` tensor on the cache's device)."""
        import torch

        self.cache = cache
        if self.padded:  # unpadded, every row holds ``width`` tokens: _sync_lengths() catches up
            self.lengths += 1
        if isinstance(tokens, list):
            tokens = torch.tensor(tokens, dtype=torch.long, device=self.next.device).unsqueeze(1)
        self.next = tokens

    def join(self, prompt_cache, keep: list[int], lengths: list[int], tokens: list[int], requests: list) -> None:
        """Add rows ``keep`` of a prefill's cache (for ``requests[i]``, i in keep) to the batch."""
        import torch

        index = torch.tensor(keep, device=self.device)
        new_layers = [(layer.keys, layer.values) for layer in prompt_cache.layers]
        if len(keep) != len(requests):
            new_layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in new_layers]
        new_width = new_layers[0][0].shape[-2]
        new_lengths = torch.tensor(lengths, dtype=torch.long, device=self.device)
        new_next = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        self._sync_lengths()
        if self.cache is None:
            self.cache = prompt_cache
            for layer, (k, v) in zip(self.cache.layers, new_layers):
                layer.keys, layer.values = k, v
            self.lengths, self.next = new_lengths, new_next
        else:
            width = max(self.width, new_width)
            for layer, (k, v) in zip(self.cache.layers, new_layers):
                if hasattr(layer, "adopt"):  # the lean runner's layer: build its buffer, with room to grow
                    room = layer.room_for(width + 1)
                    layer.adopt(_stacked(layer.keys, k, width, room), _stacked(layer.values, v, width, room), width)
                else:
                    layer.keys = _stacked(layer.keys, k, width, width)
                    layer.values = _stacked(layer.values, v, width, width)
            self.lengths = torch.cat([self.lengths, new_lengths])
            self.next = torch.cat([self.next, new_next])
        self.rows.extend(requests[i] for i in keep)
        self._update_padding()

    def drop(self, rows: list[int]) -> list:
        """Remove rows (indices) and trim columns that are padding in every row; returns their requests."""
        if not rows:
            return []
        import torch

        self._sync_lengths()
        leaving = set(rows)
        dropped = [self.rows[i] for i in rows]
        keep = [i for i in range(len(self.rows)) if i not in leaving]
        self.rows = [self.rows[i] for i in keep]
        if not keep or self.cache is None:
            self.cache = self.lengths = self.next = None
            self.rows = []
            self.padded = False
            return dropped
        index = torch.tensor(keep, device=self.lengths.device)
        self.lengths = self.lengths.index_select(0, index)
        self.next = self.next.index_select(0, index)
        trim = self.width - int(self.lengths.max())
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, trim:, :]
            layer.values = layer.values.index_select(0, index)[:, :, trim:, :]
        self._update_padding()
        return dropped

    def _sync_lengths(self) -> None:
        """Bring ``lengths`` up to date: decode steps skip it while no row is padded (each row then
        holds ``width`` tokens), which saves a tensor operation per step."""
        import torch

        if self.lengths is not None and not self.padded:
            self.lengths = torch.full_like(self.lengths, self.width)

    def _update_padding(self) -> None:
        self.padded = bool((self.lengths != self.width).any())


def _stacked(old, new, width: int, room: int):
    """``old`` rows above ``new`` rows, each left-padded with zeros to ``width`` tokens, in one new
    ``(rows, kv_heads, room, head_dim)`` tensor (positions past ``width`` left unset): one copy of
    each, where padding both and concatenating copied the old rows twice."""
    rows_old, rows_new = old.shape[0], new.shape[0]
    out = old.new_empty((rows_old + rows_new, old.shape[1], room, old.shape[3]))
    for part, tensor in ((out[:rows_old], old), (out[rows_old:], new)):
        pad = width - tensor.shape[-2]
        part[:, :, :pad].zero_()  # padding stays finite: masked scores times NaN values would be NaN
        part[:, :, pad:width] = tensor
    return out
