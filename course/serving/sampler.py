"""How the engine picks each request's next token: the sampling parameters and the sampler.

Follows vLLM's ``SamplingParams`` (``vllm/sampling_params.py``) and its V1 sampler's order: logit
bias, then repetition / frequency / presence penalties, then greedy (temperature 0) or temperature,
top-k and top-p, then a draw from the request's own generator. A temperature above 0 and below
0.01 is raised to 0.01, as vLLM does (``_MAX_TEMP``): ``logits / 1e-300`` is infinite and would
make the softmax NaN. Each row is sampled on its own, so a request whose sampling fails fails
alone, never the requests prefilled or decoded with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller temperatures are raised to it
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds vLLM accepts (torch.iinfo(torch.long))
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs  # vLLM and OpenAI clamp logit_bias values to [-100, 100]


def _require(ok: bool, param: str, problem: str) -> None:
    if not ok:
        raise InvalidSamplingParam(f"'{param}' {problem}", param)


class InvalidSamplingParam(ValueError):
    """A sampling parameter outside its range; ``param`` names the request field (the 400's ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False)
class SamplingParams:
    """How to generate for one request, validated once: the server's protocol parses a request's
    fields straight into this, and its checks are the only ones (their messages are what a client's
    400 says). Treated as read-only once made.

    Attributes:
        max_tokens: tokens to generate at most (>= 1).
        temperature: 0 = greedy (the default here, so runs are reproducible); > 0 samples, up to 2
            (OpenAI's range); values below 0.01 are raised to 0.01, as vLLM does.
        top_p: nucleus sampling mass (0 < top_p <= 1), used when temperature > 0.
        top_k: keep only the k most likely tokens (0, or -1 as vLLM also accepts, = all), used when
            temperature > 0.
        seed: seed of this request's sampler (None = unseeded), a signed 64-bit integer.
        ignore_eos: keep generating past end-of-sequence tokens (benchmarks use it for exact lengths).
        stop_token_ids: extra token ids that end the request (finish reason "stop").
        presence_penalty: subtracted from the logit of every token already generated ([-2, 2]).
        frequency_penalty: subtracted once per earlier occurrence in the output ([-2, 2]).
        repetition_penalty: divides positive (multiplies negative) logits of tokens in the prompt
            or output (> 0; 1 = off), as in vLLM and transformers.
        logit_bias: ``(token id, bias)`` pairs added to the logits (bias clamped to [-100, 100]).
        logprobs: also report the sampled token's log-probability and the ``logprobs`` most likely
            alternatives (0-20, as vLLM's default ``max_logprobs``; None = none). As vLLM's default
            (``logprobs_mode="raw_logprobs"``), they are the model's own distribution, before bias,
            penalties and temperature.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        # the comparisons are written so that NaN fails them
        _require(0 <= self.temperature <= 2, "temperature", f"must be between 0 and 2, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, "top_k", f"must be 0 or -1 (all tokens) or at least 1, got {self.top_k}")
        seeds = f"a signed 64-bit integer (in [{INT64_MIN}, {INT64_MAX}])"
        _require(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed", f"must be {seeds}, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2 <= getattr(self, name) <= 2, name, f"must be in [-2, 2], got {getattr(self, name)}")
        _require(
            0 < self.repetition_penalty < math.inf,
            "repetition_penalty",
            f"must be a finite number > 0, got {self.repetition_penalty}",
        )
        _require(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.top_k = max(self.top_k, 0)
        self.logit_bias = tuple(
            (int(t), max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(b)))) for t, b in self.logit_bias
        )
        # Greedy with nothing that changes the logits: the batch's argmax is this row's token. Worked
        # out once here, not per row per step (the sampler asks it for every row of every step).
        self.plain_greedy = self.greedy and not self.adjusts_logits
        self.stop_set = frozenset(self.stop_token_ids)  # O(1) membership per token
        self._bias_tensors = None

    def bias_tensors(self, device):
        """``logit_bias`` as (token ids, biases) tensors on ``device``, built once per params."""
        import torch

        cached = self._bias_tensors
        if cached is None or cached[0].device != torch.device(device):
            tokens = torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long, device=device)
            biases = torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32, device=device)
            cached = self._bias_tensors = (tokens, biases)
        return cached

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


class Sampler:
    """The next token of every row of a batch: ``sampler(logits, requests)``.

    ``requests`` are objects with ``params`` (:class:`SamplingParams`), ``prompt_ids`` and
    ``output_ids`` (the penalties read them) and a ``generator`` attribute the sampler keeps the
    request's seeded ``torch.Generator`` in.
    """

    def __call__(self, logits, requests: Sequence[Any]) -> tuple[list[int | Exception], Any]:
        """logits: (rows, vocab) of the last position of each row.

        Returns one int per row (or the exception that sampling that row raised), and the tokens
        as a ``(rows, 1)`` tensor when every row took the batch's argmax (else None): the engine
        then feeds that tensor straight into the next decode step instead of building a new one.
        """
        greedy = logits.argmax(-1, keepdim=True)
        tokens: list[int | Exception] = greedy.view(-1).tolist()
        all_greedy = True
        for row, request in enumerate(requests):
            if not request.params.plain_greedy:
                all_greedy = False
                try:
                    tokens[row] = self.sample_row(logits[row], request)
                except Exception as err:  # a bad request fails alone (see the module docstring)
                    tokens[row] = err
        return tokens, greedy if all_greedy else None

    @staticmethod
    def logprobs(logits, requests: Sequence[Any], tokens: Sequence[int | Exception | None]) -> list:
        """For rows that asked: ``(logprob of the token, ((token id, logprob), ...) top alternatives)``.

        logits: (rows, vocab), raw. Other rows (and failed ones) get None.
        """
        import torch

        out: list = [None] * len(requests)
        for row, (request, token) in enumerate(zip(requests, tokens)):
            k = request.params.logprobs
            if k is None or not isinstance(token, int):
                continue
            logprobs = torch.log_softmax(logits[row].float(), dim=-1)
            top = torch.topk(logprobs, k) if k else None
            alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if k else ()
            out[row] = (float(logprobs[token]), alternatives)
        return out

    def sample_row(self, logits, request) -> int:
        """One row: logits (vocab,) -> token id."""
        import torch

        params: SamplingParams = request.params
        logits = logits.float()
        if params.adjusts_logits:
            logits = self.adjust(logits.clone(), params, request.prompt_ids, request.output_ids)
        if params.greedy:
            return int(logits.argmax())
        logits = logits / params.temperature
        if params.top_k and params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(0) - sorted_probs > params.top_p  # the top token is always kept
            sorted_probs[outside] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator(request)))

    @staticmethod
    def adjust(logits, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]):
        """Logit bias and penalties, in vLLM's order, in place on ``logits`` (vocab,)."""
        import torch

        vocab = logits.shape[-1]
        if params.logit_bias:  # one vectorised add: a request with 100,000 biases must not slow the batch
            tokens, biases = params.bias_tensors(logits.device)
            logits.index_add_(0, tokens, biases.to(logits.dtype))
        if params.repetition_penalty != 1:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long, device=logits.device)] = True
            penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        if output_ids and (params.presence_penalty or params.frequency_penalty):
            ids = torch.tensor(list(output_ids), dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)
            present = (counts > 0).to(logits.dtype)
            logits = logits - params.frequency_penalty * counts - params.presence_penalty * present
        return logits

    @staticmethod
    def generator(request):
        """The request's seeded generator (made on first use), or None when it has no seed."""
        import torch

        if getattr(request, "generator", None) is None and request.params.seed is not None:
            request.generator = torch.Generator().manual_seed(request.params.seed)
        return getattr(request, "generator", None)
