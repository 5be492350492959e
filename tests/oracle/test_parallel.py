"""Drift tests for course.sim.parallel: vLLM 0.32's own pipeline split and concurrent batches.

The pipeline stages' layers (``vllm/distributed/utils.py``, ``get_pp_indices``) and the batches vLLM keeps
in flight for a pipeline (``vllm/config/vllm.py``, ``VllmConfig.max_concurrent_batches``), called from the
installed vLLM, against what course.sim.parallel says.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from course.kv import vllm
from course.kv.catalogue import catalogue, get_model
from course.sim import parallel
from course.vllm_release import VLLM_VERSION


@pytest.mark.parametrize("name", [n for n in catalogue() if get_model(n).num_layers >= 8])
@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
def test_pipeline_stages_hold_the_layers_vllm_gives_them(name, pp, monkeypatch):
    from vllm.distributed import utils

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    layers = get_model(name).num_layers
    ours = parallel.pp_layer_partition(layers, pp)
    theirs = []
    for rank in range(pp):
        start, end = utils.get_pp_indices(layers, rank, pp)
        theirs.append(end - start)
    assert ours == tuple(theirs), f"{name}, pp {pp}: course {ours}, vLLM {tuple(theirs)}"


@pytest.mark.parametrize("v2_runner", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_a_pipeline_keeps_one_batch_in_flight_per_stage(pp, async_scheduling, v2_runner):
    from vllm.config.vllm import VllmConfig

    # the property reads only these fields
    config = NS(
        parallel_config=NS(pipeline_parallel_size=pp),
        scheduler_config=NS(async_scheduling=async_scheduling),
        use_v2_model_runner=v2_runner,
    )
    theirs = VllmConfig.max_concurrent_batches.fget(config)
    assert theirs == vllm.max_concurrent_batches(async_scheduling, pp, release=VLLM_VERSION, v2_model_runner=v2_runner)
    if v2_runner or pp == 1:  # the V2 runner (0.32's GPU default); V1 adds no batch for async under PP
        assert theirs == parallel.batches_in_flight(pp, async_scheduling)
    else:
        assert theirs == pp
