"""KV-cache calculator: bytes per token, paged blocks, and the GPU-memory budget vLLM computes.

Everything here is arithmetic on a :class:`course.geometry.ModelGeometry` (from a Hugging Face
``config.json``, a path to one, or a catalogue name) and a :class:`course.hardware.HardwareSpec`.
One module per job:

* :mod:`course.kv.vllm`: the vLLM version and source files every fact was read from, its defaults
  (0.92 utilization, per-GPU scheduler defaults, prefix caching on) and its startup check;
* :mod:`course.kv.dtypes`: KV dtypes, vLLM's ``--kv-cache-dtype`` names included, with their overheads;
* :mod:`course.kv.catalogue`: the model catalogue (``course/data/kv_models.json``) and config loading;
* :mod:`course.kv.params`: exact parameter counts from a config;
* :mod:`course.kv.sizes`: bytes per token, per layer kind, per sequence and per batch;
* :mod:`course.kv.paging`: paged blocks and their waste;
* :mod:`course.kv.budget`: vLLM's budget, KV-cache groups and maximum concurrency;
* :mod:`course.kv.widget`: the notebook explorer; :mod:`course.kv.report`: one-line summaries;
* :mod:`course.kv.cli`: ``course kv``.

The module-4 notebook has learners build the core of this themselves. Sizes are bytes; GiB = 2**30
bytes, GB = 10**9 bytes (datasheets).
"""

from course import hardware
from course.kv import vllm
from course.kv.budget import (
    GiB,
    KVBudget,
    KVGroup,
    MiB,
    budget,
    kv_cache_groups,
    state_pages_per_request,
    total_weight_bytes,
)
from course.kv.catalogue import CATALOGUE_FILE, CatalogueEntry, catalogue, catalogue_entry, get_model, models
from course.kv.cli import add_cli_arguments, run_cli
from course.kv.dtypes import KV_DTYPES, KVDtype, get_kv_dtype
from course.kv.paging import PagedBlocks, page_bytes, paged_blocks
from course.kv.params import count_params
from course.kv.report import geometry_summary
from course.kv.sizes import (
    batch_bytes,
    bytes_per_token,
    kv_heads_per_gpu,
    layer_bytes_per_token,
    sequence_bytes,
    state_bytes,
)
from course.kv.widget import draw_memory_bar, explorer, memory_breakdown

VLLM_BLOCK_SIZE = vllm.BLOCK_SIZE
# The catalogue as geometries, by name (loaded at import: a small JSON file).
MODELS = models()

__all__ = [
    "CATALOGUE_FILE",
    "GiB",
    "KV_DTYPES",
    "MODELS",
    "MiB",
    "VLLM_BLOCK_SIZE",
    "CatalogueEntry",
    "KVBudget",
    "KVDtype",
    "KVGroup",
    "PagedBlocks",
    "add_cli_arguments",
    "batch_bytes",
    "budget",
    "bytes_per_token",
    "catalogue",
    "catalogue_entry",
    "count_params",
    "draw_memory_bar",
    "explorer",
    "geometry_summary",
    "get_kv_dtype",
    "get_model",
    "hardware",
    "kv_cache_groups",
    "kv_heads_per_gpu",
    "layer_bytes_per_token",
    "memory_breakdown",
    "page_bytes",
    "paged_blocks",
    "run_cli",
    "sequence_bytes",
    "state_bytes",
    "state_pages_per_request",
    "total_weight_bytes",
    "vllm",
]
