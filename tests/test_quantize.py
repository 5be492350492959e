"""Weight-only int8 and int4: the quantization itself, the kernels' answers, and the bytes a step reads."""

import pytest
import torch

from course import models, phases, quantize


def test_int8_per_channel_scales_map_each_rows_largest_weight_to_127():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.75]])
    q, scales = quantize.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert torch.allclose(scales, torch.tensor([1.0 / 127, 1.0, 3.0 / 127]))  # an all-zero row keeps scale 1
    assert q[0, 1] == -127 and q[2, 0] == 127 and torch.all(q[1] == 0)
    back = quantize.dequantize_int8(q, scales)
    assert torch.all((back - w).abs() <= scales[:, None] / 2 + 1e-7)  # within half a step per row


def test_int8_per_channel_is_not_per_tensor():
    # One row 1000x larger than the other: a per-tensor scale would round the small row to zeros.
    w = torch.stack([torch.linspace(-1, 1, 64), 1000 * torch.linspace(-1, 1, 64)])
    q, _ = quantize.quantize_int8(w)
    assert q[0].abs().max() == 127 and len(q[0].unique()) > 60


def test_quantize_rejects_what_it_cannot_quantize():
    with pytest.raises(ValueError, match=r"\(d_out, d_in\) matrix"):
        quantize.quantize_int8(torch.ones(3))
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize.quantize_int4(torch.ones(4, 100))
    lm = models.build_tiny_model(seed=0)
    with pytest.raises(ValueError, match="choose one of fp, int8-kernel"):
        quantize.use_weight_only(lm.model, "int3")


def _dequantized_copy(lm, path):
    """The model with every weight the path quantizes replaced by what its quantized form stands for."""
    import copy

    twin = copy.deepcopy(lm.model)
    with torch.no_grad():
        for m in twin.modules():
            if not isinstance(m, torch.nn.Linear):
                continue
            # A new Parameter, not copy_: the tied LM head must not round the input embedding with it.
            if path == quantize.INT4_KERNEL:
                if (group := quantize.int4_group(m.in_features)) is not None:
                    rounded = quantize.dequantize_int4(*quantize.quantize_int4(m.weight, group), group)
                    m.weight = torch.nn.Parameter(rounded)
            else:
                m.weight = torch.nn.Parameter(quantize.dequantize_int8(*quantize.quantize_int8(m.weight)))
    return twin


@pytest.mark.parametrize(
    "path", [quantize.INT8_KERNEL, quantize.INT8_DEQUANTIZE, quantize.INT4_KERNEL], ids=lambda p: p
)
def test_every_weight_path_computes_what_its_quantized_weights_stand_for(path):
    if path == quantize.INT4_KERNEL and (reason := quantize.int4_available()):
        pytest.skip(reason)
    lm = models.build_tiny_model(seed=0)
    ids = lm.random_ids(2, 9)
    with torch.inference_mode():
        reference = lm.model(ids).logits
        twin = _dequantized_copy(lm, path)(ids).logits  # built before switching: deepcopy of the plain model
        switched = quantize.use_weight_only(lm.model, path)
        # 4 layers x 7 linears + the tied LM head; int4 leaves the 4 down projections (d_in 688: no group fits)
        assert switched == (25 if path == quantize.INT4_KERNEL else 29)
        quantized = lm.model(ids).logits
        assert quantize.weight_path(lm.model) == path
        quantize.use_weight_only(lm.model, quantize.FP)
        again = lm.model(ids).logits
    assert torch.equal(again, reference) and quantize.weight_path(lm.model) == quantize.FP
    spread = float(reference.max() - reference.min())
    # The kernel computes with the rounded weights (the kernel paths in bf16 arithmetic: within 2 %).
    tolerance = 1e-3 if path == quantize.INT8_DEQUANTIZE else 2e-2
    assert float((quantized - twin).abs().max()) < tolerance * spread
    assert not torch.equal(quantized, reference)  # which really were rounded
    if path != quantize.INT4_KERNEL:  # per-channel int8 moves the logits little
        assert float((quantized - reference).abs().max()) < 0.02 * spread


def test_int4_kernel_matches_its_own_dequantized_weights():
    if reason := quantize.int4_available():
        pytest.skip(reason)
    torch.manual_seed(0)
    w, x = torch.randn(256, 512), torch.randn(3, 512)
    q, scales_and_zeros = quantize.quantize_int4(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, quantize.INT4_GROUP, scales_and_zeros)
    dequantized = quantize.dequantize_int4(q, scales_and_zeros)
    assert torch.allclose(out, x @ dequantized.T, atol=1e-3)
    groups = w.reshape(256, 4, 128)
    scale = (groups.amax(2) - groups.amin(2)) / 15
    assert ((dequantized - w).reshape(256, 4, 128).abs() <= scale[..., None] / 2 + 1e-6).all()  # half a step


def test_weight_bytes_read_counts_the_stored_format_and_skips_embedding_lookups():
    lm = models.build_tiny_model(seed=0)
    linears = [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    values = sum(m.weight.numel() for m in linears)  # the tied LM head is one of them
    rows = sum(m.weight.shape[0] for m in linears)
    others = sum(p.numel() for n, p in lm.model.named_parameters() if "norm" in n)
    assert quantize.weight_bytes_read(lm.model) == lm.weight_bytes == 4 * (values + others)
    int8 = quantize.weight_bytes_read(lm.model, quantize.INT8_KERNEL)
    assert int8 == values + 4 * rows + 4 * others  # one byte a weight, one fp32 scale a row, fp32 norms
    int4 = quantize.weight_bytes_read(lm.model, quantize.INT4_KERNEL)
    kept = [m for m in linears if quantize.int4_group(m.in_features) is None]  # the 4 down projections (d_in 688)
    packed = [m for m in linears if m not in kept]
    assert len(kept) == 4 and quantize.int4_group(688) is None and quantize.int4_group(256) == 128
    assert int4 == (
        sum(m.weight.numel() // 2 + 8 * m.weight.numel() // quantize.int4_group(m.in_features) for m in packed)
        + sum(4 * m.weight.numel() for m in kept)
        + 4 * others
    )
    assert lm.weight_bytes / int8 > 3.5  # what the roofline expects the int8 step to gain
    assert phases.decode_bytes_per_step(lm, 1, 10, int8) == int8 + 10 * lm.geometry.kv_bytes_per_token(4)


def test_measure_weight_paths_pairs_each_path_with_the_rounds_roof_and_restores_fp():
    lm = models.build_tiny_model(seed=0)
    paths = [quantize.FP, quantize.INT8_KERNEL]
    figures, roofs = quantize.measure_weight_paths(lm, paths, context=16, steps=2, rounds=3, quick=True)
    assert list(figures) == paths and quantize.weight_path(lm.model) == quantize.FP
    assert len(roofs.read_times) == 9  # three reads in each of three rounds
    for path, f in figures.items():
        assert f.step.n == 3 and f.step.low <= f.step.median <= f.step.high
        assert f.bytes_read == phases.decode_bytes_per_step(lm, 1, 16, quantize.weight_bytes_read(lm.model, path))
        assert f.predicted == pytest.approx(f.bytes_read / roofs.bandwidth)
    assert figures[quantize.INT8_KERNEL].bytes_read < figures[quantize.FP].bytes_read / 3
