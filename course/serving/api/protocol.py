"""The OpenAI-compatible wire format: request validation, error bodies and SSE chunks.

Follows vLLM 0.11 (``vllm/entrypoints/openai/``) and the OpenAI API reference:

* a stream is ``data: {json}\\n\\n`` events ending with ``data: [DONE]\\n\\n``;
* completions chunks are ``object="text_completion"`` with ``choices[i].text``; chat chunks are
  ``object="chat.completion.chunk"`` whose first chunk's delta carries the role;
* the last token's chunk carries ``finish_reason`` ("stop" or "length");
* with ``stream_options.include_usage`` every chunk has ``"usage": null`` and one more chunk
  with ``"choices": []`` and the usage comes before ``[DONE]``; with
  ``continuous_usage_stats`` every chunk carries the usage so far;
* bad requests get HTTP 400 and ``{"error": {"message", "type", "param", "code"}}``; an error
  after the stream started is sent as a ``data: {"error": ...}`` event, then ``[DONE]``.

Sampling fields are honoured as vLLM honours them (``temperature``, ``top_p``, ``top_k``, ``seed``,
``stop``, ``stop_token_ids``, ``ignore_eos``, ``logit_bias``, the presence / frequency / repetition
penalties), and ``logprobs`` / ``top_logprobs`` (the model's raw log-probabilities, as vLLM's
default), and ``echo`` (the prompt's text before the completion's); so is vLLM's ``cache_salt`` (checked
as vLLM checks it, and hashed into the prompt's prefix-cache blocks as vLLM hashes it, so that only
requests with the same salt share cached blocks). OpenAI fields this server does
not implement (``echo`` together with ``logprobs``, ``suffix``, ``best_of`` > 1,
``response_format`` other than text, ``tools``) and vLLM's extras that it does not implement
(``min_p``, ``min_tokens``, ``guided_json``, ...) are accepted at their "off" value and otherwise
refused with a 400 naming them, and so is a non-empty ``stream_options`` without ``stream: true`` (as
vLLM refuses it). Fields with no effect on the output (``user``, ``n: 1``) and unknown fields are
accepted and ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from course import vllm_release
from course.serving.sampler import InvalidSamplingParam, SamplingParams

DONE_EVENT = "data: [DONE]\n\n"
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # larger bodies get 413 (a 128k-token prompt is about 0.5 MB of text)
DEFAULT_CHAT_MAX_TOKENS = 1024  # what a chat request without max_tokens may generate, unless the operator says
# Tokens a stream may have waiting for its client beyond what its connection holds (each one event, some
# 100 bytes, or about 2 KB with 20 logprobs): a client falls this far behind only when its own kernel has
# stopped taking data (it read nothing for a long while) and the server-side buffers are full.
DEFAULT_MAX_STREAM_BACKLOG = 64
CHAT_ROLES = {"system", "user", "assistant", "developer", "tool"}


class BadRequest(Exception):
    """A client mistake: becomes HTTP ``status`` (400 unless said) with an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: int | str | None = None,
        status: int = 400,
        err_type: str = "BadRequestError",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = status if code is None else code
        self.err_type = err_type


MAX_ERROR_MESSAGE_CHARS = 2000  # an error message never echoes more of a request than this
MAX_ECHO_CHARS = 100  # a value quoted from the request (a model id, a field path) is cut to this


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters for quoting in an error message, saying how much was cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def error_body(message: str, err_type: str = "BadRequestError", param: str | None = None, code: int | str = 400):
    """``{"error": {...}}`` as vLLM sends it (``create_error_response``); the message is capped at
    :data:`MAX_ERROR_MESSAGE_CHARS`, so no error echoes a huge request back."""
    message = clip(message, MAX_ERROR_MESSAGE_CHARS)
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def sse_event(payload: Any) -> str:
    """One Server-Sent Event carrying ``payload`` as compact JSON (a str is sent as is)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


@dataclass
class GenerationRequest:
    """A validated completions or chat request, ready for the engine."""

    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stop: list[str] = field(default_factory=list)
    echo: str | None = None  # completions with echo: the prompt's text, sent before the completion's
    sampling: SamplingParams | None = None  # what the engine runs (None: greedy up to max_tokens)
    cache_salt: str | None = None  # vLLM's cache_salt: only requests with the same salt share prefix-cache blocks

    def __post_init__(self) -> None:
        if self.sampling is None:
            self.sampling = SamplingParams(max_tokens=self.max_tokens)

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token to report (0: only the chosen token's); None: none."""
        return self.sampling.logprobs


@dataclass(frozen=True)
class ServingContext:
    """What validation needs to know about the served model."""

    tokenizer: Any
    model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    # Characters of the longest token: a prompt of more than max_model_len * this many characters
    # cannot fit, and is refused without spending seconds tokenizing it (None: no such check).
    max_token_chars: int | None = None
    default_chat_max_tokens: int | None = None  # chat without max_tokens: at most this many (None: the room left)


# --- validation helpers -------------------------------------------------------------------------


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None, what: str | None = None) -> Any:
    """``body[name]`` if it has one of ``kinds`` (null = default), else BadRequest naming the field."""
    value = body.get(name)
    if value is None:
        return default
    # JSON true is not a number, although Python's bool is an int
    value_ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not value_ok:
        raise BadRequest(
            f"'{name}' must be {what or ' or '.join(_json_type(k) for k in kinds)}, got {_quoted(value)}", name
        )
    return value


def _json_type(kind: type) -> str:
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "an array",
        dict: "an object",
    }[kind]


def _quoted(value: Any) -> str:
    """``value`` as JSON, cut to 40 characters: what an error message quotes of a bad field."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


# vLLM 0.32's limits on a cache_salt (vllm/entrypoints/generate/base/protocol.py, validate_cache_salt): a
# non-empty string of at most 128 characters without any of these
CACHE_SALT_MAX_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(value: Any) -> str | None:
    """A request's ``cache_salt`` as vLLM 0.32's ``validate_cache_salt`` accepts it (None if absent), else
    BadRequest in vLLM's words: not a string or empty; longer than 128 characters or holding ``@``, ``/``,
    ``\\`` or NUL."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(value) > CACHE_SALT_MAX_CHARS or any(char in CACHE_SALT_FORBIDDEN for char in value):
        raise BadRequest(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
            "cache_salt",
        )
    return value


# Stop strings are searched in the text of every chunk, so their number and length bound the work
# one request can ask of the event loop. OpenAI accepts up to 4; vLLM sets no limit.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_JSON_DEPTH = 64  # arrays/objects nested deeper than this are refused (real requests nest < 10)


def _no_constant(name: str):
    raise BadRequest(f"The request body is not valid JSON: {name} is not a JSON number.")


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object, or BadRequest saying what is wrong with it.

    Besides syntax errors this refuses, with 400 rather than a 500 from deep inside the server:
    nesting deeper than :data:`MAX_JSON_DEPTH` (anywhere, even in a field the server ignores),
    integers longer than Python's 4,300-digit conversion limit, NaN / Infinity, and strings that
    are not valid Unicode (a lone surrogate such as ``"\\ud800"``), which no tokenizer can encode.
    """
    if not raw.strip():
        raise BadRequest("The request body is empty; send a JSON object.")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(f"The request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels.") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, and "Exceeds the limit (4300 digits)"
        raise BadRequest(f"The request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"The request body must be a JSON object, got {type(body).__name__}.")
    _check_json_tree(body)
    return body


def _check_json_tree(body: dict) -> None:
    """Depth and Unicode checks over the whole parsed body, without recursion (it may be deep)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(
                    f"'{clip(path)}' contains a lone surrogate (an unpaired \\ud800-\\udfff escape); "
                    "send valid Unicode.",
                    path.split(".")[0].split("[")[0] or None,
                ) from None
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(
                    f"The request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels (at '{clip(path)}')."
                )
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, path, depth))
                    child = f"{path}.{key}" if path else key
                else:
                    child = f"{path}[{key}]"
                stack.append((item, child, depth + 1))


def _check_model(body: dict, ctx: ServingContext) -> str:
    model = _field(body, "model", (str,), default=ctx.model_names[0])
    if model not in ctx.model_names:  # 404, as OpenAI and vLLM answer
        raise BadRequest(
            f"The model `{clip(model)}` does not exist. Served models: {clip(', '.join(ctx.model_names), 1000)}.",
            "model",
            status=404,
            err_type="NotFoundError",
        )
    return model


def _common(
    body: dict, ctx: ServingContext, kind: str, prompt_ids: list[int], default_max: int | None
) -> GenerationRequest:
    if not prompt_ids:
        raise BadRequest(
            "The prompt is empty; send at least one token.", "prompt" if kind == "completion" else "messages"
        )
    n = _field(body, "n", (int,), default=1)
    if n != 1:
        raise BadRequest(f"'n' must be 1 (this server generates one choice per request), got {n}", "n")
    max_tokens = _field(body, "max_tokens", (int,))
    if kind == "chat":
        max_tokens = _field(body, "max_completion_tokens", (int,), default=max_tokens)
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and max_tokens <= 0:
        raise BadRequest(f"'{name}' must be at least 1, got {max_tokens}", name)
    max_tokens = _output_cap(len(prompt_ids), max_tokens, default_max, ctx.max_model_len, name)
    stream = _field(body, "stream", (bool,), default=False)
    options = _field(body, "stream_options", (dict,), default={})
    if options and not stream:  # vLLM 0.32: CompletionRequest.validate_stream_options
        raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = _field(options, "include_usage", (bool,), default=True) if options else False
    continuous = _field(options, "continuous_usage_stats", (bool,), default=False) if options else False
    stop = _field(body, "stop", (str, list), default=[])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or an array of strings", "stop")
    stop = [s for s in stop if s]
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(
            f"'stop' may hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each "
            f"(got {len(stop)}, the longest {max(map(len, stop))} characters)",
            "stop",
        )
    stop_token_ids = _field(body, "stop_token_ids", (list,), default=[])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
        raise BadRequest("'stop_token_ids' must be an array of integers", "stop_token_ids")
    _refuse_unsupported(body, kind)
    cache_salt = check_cache_salt(body.get("cache_salt"))
    return GenerationRequest(
        kind=kind,
        model=_check_model(body, ctx),
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(stream and (include_usage or continuous)),
        continuous_usage=bool(stream and continuous),
        stop=stop,
        sampling=_sampling(body, ctx, kind, max_tokens, tuple(stop_token_ids)),
        cache_salt=cache_salt,
    )


def _sampling(body: dict, ctx: ServingContext, kind: str, max_tokens: int, stop_token_ids: tuple[int, ...]):
    """The request's sampling fields, type-checked here and range-checked by :class:`SamplingParams`
    (the one place their ranges are written; its error names the field for the 400)."""
    logprobs, logprobs_field = _logprobs(body, kind)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_field(body, "temperature", (int, float), default=0.0)),
            top_p=float(_field(body, "top_p", (int, float), default=1.0)),
            top_k=_field(body, "top_k", (int,), default=0),
            seed=_field(body, "seed", (int,)),
            ignore_eos=_field(body, "ignore_eos", (bool,), default=False),
            stop_token_ids=stop_token_ids,
            presence_penalty=float(_field(body, "presence_penalty", (int, float), default=0.0)),
            frequency_penalty=float(_field(body, "frequency_penalty", (int, float), default=0.0)),
            repetition_penalty=float(_field(body, "repetition_penalty", (int, float), default=1.0)),
            logit_bias=_logit_bias(body, ctx),
            logprobs=logprobs,
        )
    except InvalidSamplingParam as err:
        if err.param == "logprobs" and logprobs_field != "logprobs":  # chat names the count top_logprobs
            raise BadRequest(str(err).replace("'logprobs'", f"'{logprobs_field}'"), logprobs_field) from None
        raise BadRequest(str(err), err.param) from None


def _output_cap(
    prompt_tokens: int, max_tokens: int | None, default_max: int | None, max_model_len: int, name: str
) -> int:
    """The output cap the request runs with, as vLLM 0.32's server decides it (:mod:`course.vllm_release`).

    An output cap larger than the whole context is a 400; any other cap is clamped to the room the
    prompt leaves (``get_max_tokens``), so a prompt that fills the context exactly leaves none (vLLM
    then refuses ``max_tokens`` 0). A prompt longer than the context is not refused here: the engine
    checks every prompt where it takes it in (:func:`~course.serving.engine_client.checked_prompt`),
    and the server sends that refusal, vLLM's words, as the 400.
    """
    if max_tokens is not None and (over := vllm_release.max_tokens_error(max_tokens, max_model_len, name)):
        raise BadRequest(over, name)
    if max_tokens is None and default_max:
        max_tokens = default_max
    cap = vllm_release.clamp_max_tokens(prompt_tokens, max_tokens, max_model_len)
    if cap == 0:  # below 0 only for a prompt longer than the context, which the engine refuses
        raise BadRequest(
            f"{name} must be at least 1, got {cap}: the prompt ({prompt_tokens} tokens) fills the context of "
            f"{max_model_len} tokens",
            name,
        )
    return max(cap, 1)


def _logprobs(body: dict, kind: str) -> tuple[int | None, str]:
    """How many alternatives per token to report, vLLM's way, and the field that said so: completions
    send ``logprobs: N``; chat sends ``logprobs: true`` and ``top_logprobs: N`` (the range, 0-20, is
    :class:`SamplingParams`'s)."""
    if kind == "completion":
        count = _field(body, "logprobs", (int,))
        name = "logprobs"
    else:
        wanted = _field(body, "logprobs", (bool,), default=False)
        count = _field(body, "top_logprobs", (int,))
        name = "top_logprobs"
        if count and not wanted:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        count = (count or 0) if wanted else None
    return count, name


def _logit_bias(body: dict, ctx: ServingContext) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs: keys must be token ids of this model's vocabulary
    (the values are clamped to [-100, 100] by :class:`SamplingParams`)."""
    bias = _field(body, "logit_bias", (dict,), default={})
    pairs = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() and len(key) < 20 else None
        if token is None or not 0 <= token < ctx.vocab_size:
            raise BadRequest(
                f"'logit_bias' keys must be token ids in [0, {ctx.vocab_size}), got {_quoted(key)}", "logit_bias"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise BadRequest(f"'logit_bias' values must be numbers, got {_quoted(value)}", "logit_bias")
        pairs[token] = float(value)
    return tuple(pairs.items())


# vLLM's extra sampling fields that this server does not implement, with their "off" value
# (vllm/entrypoints/openai/completion/protocol.py in vLLM 0.32.0): sent with any other value, they get a
# 400, not silence.
VLLM_EXTRAS_NOT_IMPLEMENTED = {
    "min_p": 0,
    "min_tokens": 0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "prompt_logprobs": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
}


def _refuse_unsupported(body: dict, kind: str) -> None:
    """OpenAI fields this server does not implement: accepted at their "off" value, else a 400 naming them.

    (vLLM implements response_format and tools, and refuses ``suffix``; a client
    that asks for any of them here learns it at once instead of getting a 200 without it.)
    """
    if kind == "completion":
        if _field(body, "echo", (bool,), default=False) and body.get("logprobs") is not None:
            raise BadRequest(
                "'echo' with 'logprobs' (the prompt's logprobs) is not supported; send one of them.", "echo"
            )
        if _field(body, "suffix", (str,)):
            raise BadRequest("'suffix' is not supported (vLLM refuses it too); leave it out.", "suffix")
    best_of = _field(body, "best_of", (int,), default=1)
    if best_of != 1:
        raise BadRequest(
            f"'best_of' must be 1 (this server generates one sequence per request), got {best_of}", "best_of"
        )
    response_format = _field(body, "response_format", (dict,), default={"type": "text"})
    if response_format.get("type") != "text":
        raise BadRequest(
            f"'response_format' {_quoted(response_format.get('type'))} is not supported: structured output is not "
            'implemented here; send {"type": "text"} or leave it out.',
            "response_format",
        )
    for name, off in VLLM_EXTRAS_NOT_IMPLEMENTED.items():
        if body.get(name) is not None and body[name] != off:
            raise BadRequest(f"'{name}' (a vLLM extension) is not supported by this server; leave it out.", name)
    tools = _field(body, "tools", (list,), default=[])
    tool_choice = _field(body, "tool_choice", (str, dict), default="none" if not tools else "auto")
    if tool_choice != "none":
        name = "tools" if tools else "tool_choice"
        raise BadRequest(
            f"'{name}': tool calling is not supported by this server; leave out tools and tool_choice.", name
        )


def longest_token_chars(tokenizer) -> int:
    """Characters of the tokenizer's longest vocabulary entry (its raw form, never shorter than its text)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def _check_prompt_chars(chars: int, ctx: ServingContext, param: str) -> None:
    """Refuse, before tokenizing it, a prompt that has too many characters to fit in the context.

    A token covers at most ``max_token_chars`` characters of text, so ``chars`` characters are at
    least ``chars / max_token_chars`` tokens; the factor 2 leaves room for normalizers that merge
    characters. Tokenizing a 2 MB prompt takes seconds; this check takes none.
    """
    if ctx.max_token_chars and chars > 2 * ctx.max_token_chars * ctx.max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, your prompt has "
            f"{chars} characters, more than that many tokens can hold. Please reduce the length of the input.",
            param,
        )


def _token_ids(value: list, ctx: ServingContext, param: str) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"'{param}' must be a string or an array of token ids (integers)", param)
    if value and (min(value) < 0 or max(value) >= ctx.vocab_size):
        raise BadRequest(f"token ids in '{param}' must be in [0, {ctx.vocab_size})", param)
    return list(value)


def parse_completion(body: dict, ctx: ServingContext) -> GenerationRequest:
    """Validate a ``POST /v1/completions`` body (raises BadRequest)."""
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required: a string or an array of token ids.", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        _check_prompt_chars(len(prompt), ctx, "prompt")
        ids = ctx.tokenizer(prompt, add_special_tokens=True, verbose=False).input_ids
    elif isinstance(prompt, list):
        if prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise BadRequest("this server takes one prompt per request; send the prompts separately", "prompt")
        ids = _token_ids(prompt, ctx, "prompt")
    else:
        raise BadRequest(f"'prompt' must be a string or an array of token ids, got {_quoted(prompt)}", "prompt")
    # 16 when max_tokens is left out (the OpenAI/vLLM completions default, CompletionRequest.max_tokens = 16 in
    # vllm/entrypoints/openai/completion/protocol.py); an explicit null is vLLM's None: the room the prompt leaves
    default_max = None if "max_tokens" in body and body["max_tokens"] is None else 16
    request = _common(body, ctx, "completion", ids, default_max=default_max)
    if _field(body, "echo", (bool,), default=False):  # the prompt as sent (token ids: decoded), as vLLM does
        request.echo = prompt if isinstance(prompt, str) else ctx.tokenizer.decode(ids)
    return request


def _message_text(message: Any, index: int) -> tuple[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with 'role' and 'content', got {_quoted(message)}", "messages")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise BadRequest(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {_quoted(role)}", "messages")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):  # content parts: only text is supported here
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(f"{where}.content parts must be {{'type': 'text', 'text': ...}}", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or text parts, got {_quoted(content)}", "messages")
    return role, content


def render_chat(tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    """Prompt ids for a conversation: the tokenizer's chat template, or a plain fallback format."""
    if getattr(tokenizer, "chat_template", None):
        conversation = [{"role": role, "content": content} for role, content in messages]
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"
    return tokenizer(text, add_special_tokens=True, verbose=False).input_ids


def parse_chat(body: dict, ctx: ServingContext) -> GenerationRequest:
    """Validate a ``POST /v1/chat/completions`` body (raises BadRequest)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of {'role', 'content'} objects.", "messages")
    parsed = [_message_text(message, i) for i, message in enumerate(messages)]
    _check_prompt_chars(sum(len(content) for _, content in parsed), ctx, "messages")
    return _common(body, ctx, "chat", render_chat(ctx.tokenizer, parsed), default_max=ctx.default_chat_max_tokens)


# --- responses ------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ChunkWriter:
    """Formats one request's SSE chunks, fast: the constant parts of the JSON are built once.

    One chunk per generated token (its text may be "" while a character is incomplete), the
    last one with the finish reason; for chat a role chunk first. Identical in shape to vLLM's.
    """

    def __init__(self, request: GenerationRequest, request_id: str | None = None, created: int | None = None) -> None:
        self.request = request
        self.kind = request.kind
        prefix = "cmpl-" if request.kind == "completion" else "chatcmpl-"
        self.id = request_id or prefix + uuid.uuid4().hex
        self.created = created or int(time.time())
        obj = "text_completion" if request.kind == "completion" else "chat.completion.chunk"
        head = {"id": self.id, "object": obj, "created": self.created, "model": request.model}
        self._head = json.dumps(head, separators=(",", ":"))[:-1] + ',"choices":[{"index":0,'
        self._usage_null = ',"usage":null' if request.include_usage and not request.continuous_usage else ""
        self.prompt_tokens = len(request.prompt_ids)

    def _usage(self, completion_tokens: int) -> str:
        if self.request.continuous_usage:
            return ',"usage":' + json.dumps(usage(self.prompt_tokens, completion_tokens), separators=(",", ":"))
        return self._usage_null

    def role_chunk(self) -> str:
        """The chat stream's first chunk: the assistant role and empty content."""
        return (
            f'data: {self._head}"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]'
            f"{self._usage(0)}}}\n\n"
        )

    def token_chunk(
        self, text: str, finish_reason: str | None, completion_tokens: int, logprobs: dict | None = None
    ) -> str:
        """The chunk of one generated token (``text`` may be ""); ``logprobs``: its :class:`Logprobs` part."""
        finish = "null" if finish_reason is None else f'"{finish_reason}"'
        text_json = json.dumps(text, ensure_ascii=False)
        lp = "null" if logprobs is None else json.dumps(logprobs, separators=(",", ":"), ensure_ascii=False)
        if self.kind == "completion":
            body = f'"text":{text_json},"logprobs":{lp},"finish_reason":{finish},"stop_reason":null}}]'
        else:
            body = f'"delta":{{"content":{text_json}}},"logprobs":{lp},"finish_reason":{finish}}}]'
        return f"data: {self._head}{body}{self._usage(completion_tokens)}}}\n\n"

    def usage_chunk(self, completion_tokens: int) -> str:
        """The extra chunk before [DONE] when include_usage is set: no choices, the final usage."""
        head = self._head.removesuffix('"choices":[{"index":0,')
        total = json.dumps(usage(self.prompt_tokens, completion_tokens), separators=(",", ":"))
        return f'data: {head}"choices":[],"usage":{total}}}\n\n'

    def full_response(
        self, text: str, finish_reason: str | None, completion_tokens: int, logprobs: dict | None = None
    ) -> dict:
        """The non-streaming response body."""
        if self.kind == "completion":
            choice = {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            obj = "text_completion"
        else:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "chat.completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.request.model,
            "choices": [choice],
            "usage": usage(self.prompt_tokens, completion_tokens),
        }


class Logprobs:
    """The ``logprobs`` part of a choice, in OpenAI's two shapes (vLLM's ``_create_*_logprobs``).

    Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}``,
    the top dict holding the chosen token and its alternatives; chat: ``{"content": [{"token",
    "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``. A token is its own
    decoded text; -inf is sent as -9999.0, as vLLM does (JSON has no infinity).
    """

    def __init__(self, kind: str, tokenizer) -> None:
        self.kind, self.tokenizer = kind, tokenizer
        self.entries: list = []

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def add(self, token: int, logprob: float, top: Sequence[tuple[int, float]], text_offset: int) -> dict:
        """Record one token; returns the logprobs part of that token's own chunk."""
        text = self._text(token)
        if self.kind == "completion":
            alternatives = {self._text(t): max(lp, -9999.0) for t, lp in top}
            alternatives[text] = max(logprob, -9999.0)
            entry = (text, max(logprob, -9999.0), alternatives, text_offset)
            self.entries.append(entry)
            return self._completion([entry])
        entry = {
            "token": text,
            "logprob": max(logprob, -9999.0),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": t, "logprob": max(lp, -9999.0), "bytes": list(t.encode("utf-8"))}
                for t, lp in ((self._text(i), lp) for i, lp in top)
            ],
        }
        self.entries.append(entry)
        return {"content": [entry]}

    @staticmethod
    def _completion(entries) -> dict:
        return {
            "tokens": [e[0] for e in entries],
            "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries],
            "text_offset": [e[3] for e in entries],
        }

    def whole(self) -> dict:
        """Every token's, for the non-streaming response."""
        return self._completion(self.entries) if self.kind == "completion" else {"content": list(self.entries)}


def find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index of the earliest stop string that begins at or after ``start`` in ``text``, or None."""
    best = None
    for stop in stops:
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best):
            best = index
    return best
