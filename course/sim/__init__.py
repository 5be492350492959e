"""A discrete-event simulator of an LLM serving engine's scheduler (module 3).

Quick start::

    from course import hardware, kv, workload
    from course.sim import SimConfig, RooflineCost, simulate

    requests = workload.poisson(rate=20, n=2000, prompt_tokens=workload.lognormal(512, 0.8), output_tokens=200)
    cost = RooflineCost(kv.get_model("Llama-3-8B"), hardware.gpu("H100-SXM"))
    result = simulate(requests, SimConfig(scheduler="continuous", num_blocks=20000), cost)
    print(result.table(ttft_slo=0.5, tpot_slo=0.05))

Pieces: :class:`BlockManager` (paged KV blocks, prefix caching), the policies in
:mod:`course.sim.steps` (vLLM V1 continuous batching, V0 prefill-first, static batching) and their
readable ledger in :mod:`course.sim.harness`; :func:`simulate`, the fast ledgers; both run under the
one clock of :mod:`course.sim.loop`, by the scheduling rules of :mod:`course.rules`; the cost models
:class:`RooflineCost` and :class:`LinearCost`, the front end's timing :class:`FrontEnd` and both together,
:class:`ServerCost`, as :mod:`course.sim.calibration` fits them; :class:`SimResult` with traces, goodput and KV usage;
plots in :mod:`course.sim.plots`; ``course simulate`` on the command line.
"""

from course.sim.blocks import BlockManager, prompt_block_hashes
from course.sim.calibration import samples_from_timings
from course.sim.config import SCHEDULERS, SimConfig, kv_blocks
from course.sim.cost import ROOFLINE_EFFICIENCY, LinearCost, RooflineCost, ServerCost, StepSample
from course.sim.frontend import FrontEnd
from course.sim.request import SimRequest
from course.sim.results import RequestRecord, SimResult, StepLog
from course.sim.simulator import simulate
from course.sim.workload_variants import cap_output, scale_prompts, with_system_prompt
from course.units import cdiv

__all__ = [
    "ROOFLINE_EFFICIENCY",
    "SCHEDULERS",
    "BlockManager",
    "FrontEnd",
    "LinearCost",
    "RequestRecord",
    "RooflineCost",
    "ServerCost",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "StepLog",
    "StepSample",
    "cap_output",
    "cdiv",
    "kv_blocks",
    "prompt_block_hashes",
    "samples_from_timings",
    "scale_prompts",
    "simulate",
    "with_system_prompt",
]
