"""The course's language models: a tiny offline Llama for every runtime, a real one on GPUs.

The tiny model has the architecture of the real thing (Llama, grouped-query attention: 4
layers, 4 query heads sharing 2 KV heads, head_dim 64) with random weights drawn from a seed,
and a byte-level BPE tokenizer shipped in ``course/data/tokenizer.json``. It needs no network
and is ready in well under a second once torch and transformers are imported. Its text is
gibberish: the course measures *time*, and time does not care what the tokens say.

The *realistic* profile (:func:`build_realistic_model`) is the same kind of Llama at a size
that shows the physics of the two phases: 170 M parameters, whose weights (680 MB in fp32)
are far larger than any CPU's last-level cache, so every decode step really streams them from
memory. Module 1 times prefill and decode on it; everything where speed matters (servers,
tests) keeps the tiny model. On a GPU runtime without the Hub, :func:`load_model` builds
Qwen2.5-0.5B's geometry with random weights the same way (:func:`build_random_hub_geometry`),
which times like the real model.

The cache helpers hide the one API difference across transformers 5.x: the forward keyword
and output field are ``past_key_values`` up to 5.2x and ``cache`` from 5.24 on.
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from course.geometry import ModelGeometry, from_hf_config

TOKENIZER_FILE = Path(__file__).parent / "data" / "tokenizer.json"
TINY_NAME = "course-tiny-llama"
# A real small GQA model (14 query heads, 2 KV heads) for GPU runtimes with Hub access.
HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"

TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: each KV head serves two query heads
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]

REALISTIC_NAME = "course-llama-170m"
# The tiny model's Llama (head_dim 64, 4,096 positions, tied embeddings) at a size of the course's
# choosing (the issue asks for 100-200 M parameters): wide enough (hidden 1024) that every linear
# layer is a real matrix-vector product, few enough layers (12) that Python's per-layer cost stays
# small beside the weight reads. 32,000 is Llama-2's vocabulary size; the course tokenizer covers
# ids below 2,048, the rest of the embedding is only read.
REALISTIC_CONFIG: dict[str, Any] = TINY_CONFIG | dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,  # GQA: each KV head serves four query heads
)


# --- tokenizer --------------------------------------------------------------------------------


def train_tokenizer(files: list[str], vocab_size: int = 2048):
    """Train the byte-level BPE tokenizer that ships in course/data (maintainers only).

    ``python -m course.models`` retrains it on the Python standard library's sources; the
    committed file keeps every runtime on identical token ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    return tokenizer


@cache
def _tokenizer_json() -> str:
    return TOKENIZER_FILE.read_text()


def load_tokenizer():
    """The course tokenizer as a transformers fast tokenizer (no network)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    tokenizer.model_max_length = TINY_CONFIG["max_position_embeddings"]
    return tokenizer


def _llama_config(settings: dict[str, Any], tokenizer):
    """A LlamaConfig of ``settings`` with the course tokenizer's vocabulary size (unless ``settings``
    names one) and special-token ids."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **{"vocab_size": len(tokenizer)}
        | settings
        | dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


# --- cache API across transformers 5.x ----------------------------------------------------------


@cache
def _cache_keyword(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model):
    """An empty dynamic KV cache for ``model``."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def forward(model, input_ids, cache=None, **kwargs):
    """One forward pass that reads and extends ``cache``; returns (logits, cache).

    input_ids: (batch, new_tokens) token ids. logits: (batch, new_tokens, vocab).
    """
    kwargs[_cache_keyword(type(model))] = cache if cache is not None else new_cache(model)
    out = model(input_ids=input_ids, use_cache=True, **kwargs)
    new = out["cache"] if "cache" in out else out["past_key_values"]
    return out.logits, new


def cache_layers(cache) -> list[tuple[Any, Any]]:
    """(keys, values) per layer, each (batch, kv_heads, seq_len, head_dim)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_nbytes(cache) -> int:
    """Bytes held by the keys and values of every layer."""
    return sum(k.nelement() * k.element_size() + v.nelement() * v.element_size() for k, v in cache_layers(cache))


# --- the model wrapper --------------------------------------------------------------------------


@dataclass
class LanguageModel:
    """A causal LM ready for timing: model, tokenizer, where it runs and its geometry."""

    model: Any
    tokenizer: Any
    name: str
    source: str  # how it was obtained, in words
    geometry: ModelGeometry

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def random_ids(self, batch: int, length: int, seed: int = 0):
        """(batch, length) token ids drawn from the ordinary (non-special) vocabulary."""
        import torch

        generator = torch.Generator().manual_seed(seed)
        low = len(SPECIAL_TOKENS) if self.name in OFFLINE_MODELS else 0  # the course tokenizer's specials
        ids = torch.randint(low, self.vocab_size, (batch, length), generator=generator)
        return ids.to(self.device)

    def encode(self, text: str):
        """(1, tokens) ids of ``text`` on the model's device."""
        return self.tokenizer(text, return_tensors="pt").input_ids.to(self.device)

    def describe(self) -> str:
        g = self.geometry
        return (
            f"{self.name} [{self.source}]: {self.num_params / 1e6:.2f} M parameters, {g.num_layers} layers, "
            f"{g.num_query_heads} query heads / {g.num_kv_heads} KV heads ({g.attention}), head_dim {g.head_dim}, "
            f"{str(self.dtype).removeprefix('torch.')} on {self.device}"
        )


def build_tiny_model(seed: int = 0, device: str = "cpu", dtype=None) -> LanguageModel:
    """The tiny Llama with weights drawn from ``seed`` (same seed, same weights)."""
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = load_tokenizer()
    config = _llama_config(TINY_CONFIG, tokenizer)
    previous = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    torch.random.set_rng_state(previous)  # building the model must not disturb the caller's seed
    model = model.to(device=device, dtype=dtype or torch.float32).eval()
    geometry = from_hf_config(config, name=TINY_NAME, num_params=sum(p.numel() for p in model.parameters()))
    return LanguageModel(model, tokenizer, TINY_NAME, f"built offline from seed {seed}", geometry)


def save_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny model and tokenizer to a folder that ``from_pretrained`` and
    ``transformers serve`` can load."""
    return save_model(build_tiny_model(seed), path)


def save_model(lm: LanguageModel, path: str | Path) -> Path:
    """Write ``lm``'s weights, config and tokenizer where ``from_pretrained`` can load them."""
    path = Path(path)
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return path


def _random_model(config, seed: int, device: str, dtype):
    """A transformers causal LM of ``config`` with weights drawn from ``seed``, built on ``device``.

    The weights are initialised directly in ``dtype`` on ``device`` (no fp32 copy on the host
    first), and the caller's random state is left as it was.
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:  # transformers >= 5.x: allocate without running the (slow, per-module) initialisers
        from transformers.initialization import no_init_weights
    except ImportError:  # older 5.x: let it initialise, then overwrite below
        from contextlib import nullcontext as no_init_weights

    previous_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device), no_init_weights():
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.tie_weights()  # skipped with the initialisers; tied embeddings must share one tensor
    # One pass of a seeded generator over every weight, in a fixed order (tied weights once):
    # uniform with the standard deviation 0.02 of the transformers initialiser, norms at 1,
    # biases at 0. Several times faster than the library's initialisers on a laptop CPU.
    if str(device) == "meta":  # shapes only (parameter counts): nothing to draw
        return model.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    bound = 0.02 * 3**0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:  # drawn in fp32, so every dtype gets the same weights, rounded
                draw = torch.empty(param.shape, device=device, dtype=torch.float32)
                param.copy_(draw.uniform_(-bound, bound, generator=generator))
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.zero_()
    return model.to(device=device, dtype=dtype).eval()


def build_realistic_model(seed: int = 0, device: str = "cpu", dtype=None) -> LanguageModel:
    """The 170 M-parameter Llama of :data:`REALISTIC_CONFIG` with weights drawn from ``seed``.

    Deterministic (same seed, device and dtype: same weights) and offline. dtype defaults to
    fp32, the dtype every CPU's math library handles well; module 1 compares it with bf16.
    """
    import torch

    tokenizer = load_tokenizer()
    config = _llama_config(REALISTIC_CONFIG, tokenizer)
    model = _random_model(config, seed, device, dtype or torch.float32)
    geometry = from_hf_config(config, name=REALISTIC_NAME, num_params=sum(p.numel() for p in model.parameters()))
    return LanguageModel(model, tokenizer, REALISTIC_NAME, f"built offline from seed {seed}", geometry)


def build_random_hub_geometry(name: str = HUB_MODEL, seed: int = 0, device: str = "cpu", dtype=None) -> LanguageModel:
    """A catalogue model's architecture (``course/data/kv_models.json``) with random weights.

    What a GPU runtime without Hub access runs instead of the real model: the same layers and
    sizes, so it times the same, but its text is gibberish. The course tokenizer stands in for
    the model's own (its ids are a subset of the model's vocabulary).
    """
    import torch
    from transformers import AutoConfig

    from course.kv import catalogue_entry

    entry = catalogue_entry(name)
    fields = {k: v for k, v in entry.config.items() if k not in ("model_type", "torch_dtype")}
    config = AutoConfig.for_model(entry.config["model_type"], **fields)
    if dtype is None:
        on_gpu = str(device).startswith("cuda")
        dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if on_gpu else torch.float32
    model = _random_model(config, seed, device, dtype)
    label = f"{entry.name} (random weights)"
    geometry = from_hf_config(config, name=label, num_params=sum(p.numel() for p in model.parameters()))
    source = f"{entry.name}'s architecture with random weights from seed {seed} (no Hub); config: {entry.source}"
    return LanguageModel(model, load_tokenizer(), label, source, geometry)


def _hub_disabled() -> str | None:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}:
            return f"{var} is set"
    return None


class ModelUnavailable(RuntimeError):
    """The model asked for cannot be loaded, and no fallback to another model was asked for."""


def load_hub_model(name: str, device: str, dtype=None, source: str = "Hugging Face Hub") -> LanguageModel:
    """Load a real model from the Hugging Face Hub or a local folder (raises when it cannot)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is None:
        bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
        dtype = torch.bfloat16 if bf16 else (torch.float16 if device.startswith("cuda") else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()
    geometry = from_hf_config(model.config, name=name, num_params=sum(p.numel() for p in model.parameters()))
    return LanguageModel(model, tokenizer, name, source, geometry)


def load_model(
    name: str | None = None,
    *,
    device: str | None = None,
    allow_hub: bool | None = None,
    seed: int = 0,
    verbose: bool = True,
    offline: str = TINY_NAME,
    fallback: bool | None = None,
) -> LanguageModel:
    """The model a notebook should use on this runtime.

    On a GPU runtime with Hub access this loads a real small model (``HUB_MODEL``, or
    ``name``); everywhere else, or when the Hub cannot be reached, it builds an offline model
    (``offline``) and says why. Asking for an offline model by name always works, and so does
    a local model folder, whatever the Hub settings (``HF_HUB_OFFLINE`` does not apply to it).

    A model asked for by name or folder is never silently replaced: when it cannot be loaded,
    :class:`ModelUnavailable` names it, the model that would have stood in for it, and why.

    Args:
        name: a Hub model id, a local model folder, ``TINY_NAME`` or ``PROSE_NAME``; None picks
            for the runtime.
        device: "cuda" or "cpu"; None = the GPU when there is one.
        allow_hub: try the Hub at all; None = only on a GPU runtime.
        seed: seed of the tiny model's weights (the prose model's are trained, not drawn).
        verbose: print what was loaded and why.
        offline: the model built where no Hub model is loaded on a CPU: ``TINY_NAME`` (random
            weights, gibberish text, the fastest to build) or ``PROSE_NAME`` (trained on the course's
            prose, so its text reads as text; built with the tiny model's 4,096-token context, see
            :func:`build_prose_model`). A GPU runtime without the Hub gets the Hub model's geometry
            with random weights instead, so that its timings carry over.
        fallback: when the model cannot be loaded, use the offline stand-in (True, saying so) or
            raise :class:`ModelUnavailable` (False). None: fall back only when ``name`` is None
            (the runtime's own choice, as the notebooks rely on).
    """
    import torch

    if offline not in OFFLINE_MODELS:
        raise ValueError(f"offline must be one of {', '.join(OFFLINE_MODELS)}; got {offline!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name in OFFLINE_MODELS:
        return _build_offline_model(name, device, seed, "asked for by name", verbose)
    if allow_hub is None:
        allow_hub = device.startswith("cuda") or name is not None
    local = name is not None and Path(name).expanduser().is_dir()
    lm, reason = _load_real_model(name, device, allow_hub, local, verbose)
    if lm is not None:
        return lm
    # The stand-in: on a GPU runtime, a Hub model's architecture with random weights; elsewhere, and for a
    # local folder, the offline model.
    gpu_stand_in = device.startswith("cuda") and not local
    stand_in = f"{name or HUB_MODEL} (random weights)" if gpu_stand_in else offline
    if name is not None:  # asked for: never replaced silently
        if not fallback:
            raise ModelUnavailable(
                f"{name} was asked for but cannot be loaded: {reason}. Not using {stand_in} in its place "
                "(pass fallback=True to load_model, or --allow-fallback to course serve, to use it)."
            )
        reason = f"{name} was asked for but cannot be loaded ({reason}); using {stand_in} in its place"
    if gpu_stand_in:
        # A GPU runtime without the Hub still gets the real model's size, so the timings carry over.
        lm = build_random_hub_geometry(name or HUB_MODEL, seed=seed, device=device)
        if verbose:
            print(f"Using {lm.name}: {reason}. It times like the real model; its text is gibberish.\n{lm.describe()}")
        return lm
    return _build_offline_model(offline, device, seed, reason, verbose)


def _load_real_model(
    name: str | None, device: str, allow_hub: bool, local: bool, verbose: bool
) -> tuple[LanguageModel | None, str]:
    """The local folder ``name`` (when ``local``) or the Hub model (``name`` or ``HUB_MODEL``):
    (the model, "") when it loads, else (None, why not)."""
    if local:
        return _timed_load(
            str(Path(name).expanduser()), device, verbose, f"could not load the local folder {name}",
            shown_as=name, source=f"local folder {name}",
        )  # fmt: skip
    if not allow_hub:
        return None, "CPU runtime: the real model would take minutes per measurement here"
    if blocked := _hub_disabled():
        return None, f"the Hub is switched off ({blocked})"
    hub_name = name or HUB_MODEL
    return _timed_load(hub_name, device, verbose, f"could not load {hub_name} from the Hub")


def _timed_load(
    path: str, device: str, verbose: bool, failure: str, shown_as: str | None = None, **options: str
) -> tuple[LanguageModel | None, str]:
    """:func:`load_hub_model` of ``path`` (``options`` passed on), saying how long it took:
    (the model, named ``shown_as`` when given, "") or (None, ``failure`` with the error's first line)."""
    start = time.perf_counter()
    try:
        lm = load_hub_model(path, device, **options)
    except Exception as err:  # no network, no such model, gated model, not a model folder, out of memory ...
        first_line = (str(err).strip().splitlines() or [""])[0][:160]
        return None, f"{failure} ({type(err).__name__}: {first_line})"
    if shown_as is not None:
        lm.name = shown_as
    if verbose:
        print(f"Loaded {lm.describe()} in {time.perf_counter() - start:.1f} s")
    return lm, ""


def _build_offline_model(offline: str, device: str, seed: int, reason: str, verbose: bool) -> LanguageModel:
    """The offline model ``offline`` (``TINY_NAME`` or ``PROSE_NAME``), saying why it is used (``reason``)."""
    if offline == PROSE_NAME:
        # The tiny model's context, so that either offline model takes the same prompts and server limits.
        context = TINY_CONFIG["max_position_embeddings"]
        lm = build_prose_model(device=device, verbose=False, max_positions=context)
        if verbose:
            print(
                f"Using the prose offline model: {reason}. Its text reads as the course's prose; it was "
                f"trained on {PROSE_TRAINING['seq_len']}-token windows and its text degrades past them (its "
                f"context is {context:,} positions).\n{lm.describe()}"
            )
        return lm
    lm = build_tiny_model(seed, device=device)
    if verbose:
        print(f"Using the tiny offline model: {reason}.\n{lm.describe()}")
    return lm


def load_phase_model(*, device: str | None = None, dtype=None, seed: int = 0, verbose: bool = True) -> LanguageModel:
    """The model that module 1 times prefill and decode on: big enough to show the physics.

    On a GPU runtime: :func:`load_model` (the real Qwen2.5-0.5B-Instruct, or its architecture
    with random weights when the Hub is unreachable). On a CPU: the 170 M-parameter offline
    Llama of :func:`build_realistic_model` (the real model's 494 M parameters would make every
    prefill sweep take minutes on a laptop), in ``dtype`` (default fp32).
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        return load_model(device=device, seed=seed, verbose=verbose)
    start = time.perf_counter()
    lm = build_realistic_model(seed, device=device, dtype=dtype)
    if verbose:
        print(
            f"Built {lm.describe()} in {time.perf_counter() - start:.1f} s\n  weights: {lm.weight_bytes / 1e6:,.0f} MB"
        )
    return lm


# --- a tiny model trained on the course's own prose (module 5) ----------------------------------
#
# The random tiny model above streams gibberish, so no quality effect can be measured with it. This one
# has the same architecture at a smaller size (0.66 M parameters) and was trained for 1,000 steps (about five
# minutes on one CPU core), deterministically, on ``course/data/course_prose.txt``: the course's own
# explanations (MIT, like the rest of the course), extracted from the module 1-4 notebooks by
# ``write_prose_corpus``. Its text reads as the course's prose and its perplexity on held-out paragraphs
# means something. The trained weights ship in ``course/data``; without them it trains and caches.

PROSE_NAME = "course-prose-llama"
OFFLINE_MODELS = (TINY_NAME, PROSE_NAME)  # what load_model builds without the Hub, by name
PROSE_CORPUS_FILE = Path(__file__).parent / "data" / "course_prose.txt"
# The weights ``train_prose_model()`` produced (fp16, 1.3 MB; the tied output layer is the embedding), so
# that every runtime gets the same model in a fraction of a second. Retraining reproduces them on the same
# torch build and CPU; elsewhere float rounding in the kernels makes it a slightly different model.
PROSE_WEIGHTS_FILE = Path(__file__).parent / "data" / "course_prose_llama.pt"
PROSE_CONFIG: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA, as the tiny model
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
PROSE_TRAINING: dict[str, Any] = dict(steps=1000, batch=16, seq_len=64, lr=3e-3, seed=0, held_out_every=10)


def write_prose_corpus(notebooks: list[str | Path], path: str | Path = PROSE_CORPUS_FILE) -> Path:
    """Write the markdown prose of ``notebooks`` as plain paragraphs (maintainers only).

    Links keep their text, URLs, code spans' backticks, headings' hashes, tables and math go, so what
    is left is sentences. The shipped file was written with
    ``write_prose_corpus(sorted(glob.glob("solutions/m[1-4]*/*.ipynb")))`` from the repository root.
    """
    import json
    import re

    paragraphs = []
    for notebook in notebooks:
        cells = json.loads(Path(notebook).read_text())["cells"]
        for cell in cells:
            if cell["cell_type"] != "markdown":
                continue
            text = "".join(cell["source"])
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [text](url) -> text
            text = re.sub(r"https?://\S+", "", text)
            text = re.sub(r"\$[^$]*\$", "", text)
            text = text.replace("`", "").replace("**", "").replace("*", "")
            for block in re.split(r"\n\s*\n", text):
                lines = [line for line in block.splitlines() if not line.lstrip().startswith("|")]
                block = " ".join(line.strip().lstrip("#").strip() for line in lines).strip()
                if len(block) > 40:
                    paragraphs.append(re.sub(r"\s+", " ", block))
    path = Path(path)
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def prose_corpus() -> tuple[str, str]:
    """(training text, held-out text) of the course prose: every ``held_out_every``-th paragraph is held out."""
    paragraphs = [p for p in PROSE_CORPUS_FILE.read_text().split("\n\n") if p.strip()]
    every = PROSE_TRAINING["held_out_every"]
    train = [p for i, p in enumerate(paragraphs) if i % every != every - 1]
    held = [p for i, p in enumerate(paragraphs) if i % every == every - 1]
    return "\n\n".join(train), "\n\n".join(held)


def _prose_cache_path() -> Path:
    import hashlib

    import torch

    key = hashlib.sha256(
        (
            PROSE_CORPUS_FILE.read_text()
            + repr(sorted(PROSE_CONFIG.items()))
            + repr(sorted(PROSE_TRAINING.items()))
            + _tokenizer_json()
            + torch.__version__
        ).encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("COURSE_CACHE_DIR") or Path.home() / ".cache" / "llm-serving-course")
    return root / f"{PROSE_NAME}-{key}.pt"


def train_prose_model(steps: int | None = None, verbose: bool = False) -> tuple[Any, list[float]]:
    """Train the prose model from scratch; returns (LlamaForCausalLM, loss per step).

    Deterministic: fixed seeds, batches drawn from a seeded generator, one CPU thread while training
    (so the same torch build gives the same weights on any machine).
    """
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = load_tokenizer()
    settings = PROSE_TRAINING
    steps = settings["steps"] if steps is None else steps
    train_text, _ = prose_corpus()
    ids = torch.tensor(tokenizer(train_text, add_special_tokens=False, verbose=False).input_ids)
    previous_rng, previous_threads = torch.random.get_rng_state(), torch.get_num_threads()
    torch.manual_seed(settings["seed"])
    torch.set_num_threads(1)
    try:
        model = LlamaForCausalLM(_llama_config(PROSE_CONFIG, tokenizer))
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, settings["lr"], total_steps=max(steps, 1), pct_start=0.1
        )
        batches = torch.Generator().manual_seed(settings["seed"])
        seq, losses = settings["seq_len"], []
        model.train()
        for step in range(steps):
            starts = torch.randint(0, len(ids) - seq, (settings["batch"],), generator=batches)
            batch = torch.stack([ids[s : s + seq] for s in starts.tolist()])
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss  # the model shifts the labels
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if verbose and step % 40 == 0:
                print(f"  step {step:4d}: loss {losses[-1]:.3f}")
    finally:
        torch.random.set_rng_state(previous_rng)
        torch.set_num_threads(previous_threads)
    return model.eval(), losses


def build_prose_model(
    device: str = "cpu", verbose: bool = True, retrain: bool = False, max_positions: int | None = None
) -> LanguageModel:
    """The tiny Llama trained on the course's prose: the shipped weights, else a cached or fresh training run.

    ``retrain=True`` ignores the shipped file (minutes on a CPU; cached under ``COURSE_CACHE_DIR`` or
    ``~/.cache/llm-serving-course`` afterwards).

    ``max_positions`` sets the context (``config.max_position_embeddings``, what servers check prompts
    against; default :data:`PROSE_CONFIG`'s 512). The weights do not depend on it: the model is a Llama
    with default RoPE, whose rotation frequencies are fixed (``rope_theta``, ``head_dim``) and applied
    to each position as it comes, so a longer context gives the same outputs for the positions both
    allow (tests/test_prose_model.py checks it). What the model has learnt does not stretch with it: it
    was trained on ``PROSE_TRAINING["seq_len"]`` (64) token windows, and its held-out perplexity rises
    past them (the weights shipped on 2026-12-03, measured with transformers 5.24, torch 2.13 on a CPU:
    about 131 in the first 64 positions, 167 at positions 64-511 and 192 at 512-2,047; chance is the
    vocabulary, 2,048).
    """
    import torch
    from transformers import LlamaForCausalLM

    if max_positions is None:
        max_positions = PROSE_CONFIG["max_position_embeddings"]
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions must be a positive number of tokens; got {max_positions!r}")
    tokenizer = load_tokenizer()
    cached = _prose_cache_path()
    if not retrain and PROSE_WEIGHTS_FILE.exists() or cached.exists():
        path = PROSE_WEIGHTS_FILE if not retrain and PROSE_WEIGHTS_FILE.exists() else cached
        previous = torch.random.get_rng_state()
        model = LlamaForCausalLM(_llama_config(PROSE_CONFIG, tokenizer))
        torch.random.set_rng_state(previous)  # building the model must not disturb the caller's seed
        state = {name: tensor.float() for name, tensor in torch.load(path, weights_only=True).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(
                f"{path} does not hold the prose model's weights (missing {missing}, unexpected {unexpected})"
            )
        source = f"trained on the course prose, weights from {path.name}"
    else:
        start = time.perf_counter()
        model, losses = train_prose_model()
        source = (
            f"trained on the course prose for {len(losses)} steps in {time.perf_counter() - start:.1f} s "
            f"(loss {losses[0]:.2f} -> {losses[-1]:.2f})"
        )
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            torch.save({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, cached)
        except OSError as err:  # a read-only home: train again next time
            source += f"; not cached ({err.strerror})"
    model.config.max_position_embeddings = max_positions  # the weights and RoPE frequencies stay as trained
    model = model.to(device=device, dtype=torch.float32).eval()
    geometry = from_hf_config(model.config, name=PROSE_NAME, num_params=sum(p.numel() for p in model.parameters()))
    lm = LanguageModel(model, tokenizer, PROSE_NAME, source, geometry)
    if verbose:
        print(lm.describe())
    return lm


if __name__ == "__main__":  # maintainers: retrain the shipped tokenizer
    import glob
    import sysconfig

    sources = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:80]
    trained = train_tokenizer(sources)
    TOKENIZER_FILE.parent.mkdir(exist_ok=True)
    trained.save(str(TOKENIZER_FILE))
    print(f"wrote {TOKENIZER_FILE} ({trained.get_vocab_size()} tokens, trained on {len(sources)} files)")
