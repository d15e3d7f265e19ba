"""The Triton decode kernel against the layer's ``materialize()`` + plain softmax: in Triton's interpreter on CPU
(here and in CI), or compiled on a CUDA GPU when ``TRITON_INTERPRET=0`` and torch sees one (`TRITON_INTERPRET=0 python -m pytest tests/test_triton_attention.py`).

The kernel's reading of the codes is compared bit for bit; the attention to float32 summation order (tiled dot
products, online softmax, log-sum-exp merges; rotated heads also round differently, the query being rotated
instead of every key): ``TOL`` is ~20x the largest difference seen (2.7e-7), and every case also checks that the
output is far (``> 100 * TOL``) from attention over the unquantized K/V, so the codes are really read.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (`make install` installs it from requirements.txt)")

from kvguard import triton_attention as ta  # noqa: E402

if not ta.INTERPRETED and not torch.cuda.is_available():  # conftest.py sets TRITON_INTERPRET=1 unless told otherwise
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA GPU: the kernel can run nowhere", allow_module_level=True)
# Interpreted on CPU; compiled on the GPU otherwise. The random tensors are drawn on CPU either way (same values).
DEVICE = torch.device("cpu") if ta.INTERPRETED else torch.device("cuda")

from kvguard.attention import expand_kv  # noqa: E402
from kvguard.cache_layer import KVGuardLayer, KVGuardSlidingLayer  # noqa: E402
from kvguard.config import CacheConfig  # noqa: E402
from kvguard.quantizer import Axis, QuantSpec, quantize  # noqa: E402

B, H, REP, D = 2, 3, 2, 16
CFG = CacheConfig(residual=8, sinks=2, group_size=8, fp_dtype="float32")
TOL = 5e-6


def kv(n: int, seed: int, batch: int = B, device: torch.device = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(batch, H, n, D, generator=gen), torch.randn(batch, H, n, D, generator=gen)
    return keys.to(device), values.to(device)


def filled(layer: KVGuardLayer, n: int, seed: int = 0, chunk: int = 16, batch: int = B):
    """Feed ``n`` random tokens in chunks; the original K/V."""
    keys, values = kv(n, seed, batch)
    for start in range(0, n, chunk):
        layer.update(keys[..., start:start + chunk, :], values[..., start:start + chunk, :])
    return keys, values


def query(t_q: int = 1, seed: int = 7, batch: int = B) -> torch.Tensor:
    return torch.randn(batch, H * REP, t_q, D, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def reference(layer, q, keys=None, values=None, mask=None, scaling=None, softcap=None, past=None):
    """Softmax attention over ``past`` (default ``layer.materialize()``) plus the new tokens, float32."""
    k, v = past or layer.materialize(torch.float32)
    if keys is not None:
        k, v = torch.cat([k, keys], dim=-2), torch.cat([v, values], dim=-2)
    s = q @ expand_kv(k, REP).transpose(-1, -2) * (D ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s + mask
    return torch.softmax(s, dim=-1) @ expand_kv(v, REP)


def run_kernel(layer, q, *, keys=None, values=None, mask=None, **kw):
    out = ta.decode_attention(layer.stored_read(), q, keys, values, mask, **kw)
    return out, reference(layer, q, keys, values, mask, kw.get("scaling"), kw.get("softcap"))


def assert_close_and_quantized(out, expected, layer, q, originals, new=(None, None), mask=None, **kw):
    """``out`` matches the reference, and is far from attention over the original K/V (the codes are read)."""
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    diff = (out - expected).abs().max().item()
    assert diff < TOL, f"largest difference from the reference {diff:.2e}"
    past = tuple(x[..., layer.offset:, :] for x in originals)
    exact = reference(layer, q, *new, mask, kw.get("scaling"), kw.get("softcap"), past=past)
    assert (out - exact).abs().max() > 100 * TOL


# ------------------------------------------------------------------------------------------------ the codes
@pytest.mark.parametrize("precision", ["int8", "int4", "int3", "int2"])
def test_kernel_reads_the_codes_bit_for_bit(precision):
    x = torch.randn(1, H, 48, D, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 3  # batch 1: interpreter
    tensors = [quantize(x, QuantSpec(precision, Axis.CHANNEL, 8)), quantize(x, QuantSpec(precision, Axis.TOKEN, 8))]
    if precision == "int8":  # calibrated scales: one per head and channel, shared by every token
        absmax = x.abs().amax((0, 2), keepdim=True) * 0.8
        tensors.append(quantize(x, QuantSpec(precision, Axis.CHANNEL, 8, static=True), absmax))
    for qt in tensors + [t.drop_front(16) for t in tensors]:  # drop_front: strided views, as sliding layers hold
        assert torch.equal(ta.dequantize(qt), qt.dequantize(torch.float32))


# ------------------------------------------------------------------------------------------------ one layer
MIXED = ("int4", "int2", "fp16")


@pytest.mark.parametrize("precision, rotated", [
    ("int8", (False, False)), ("int4", (False, False)), ("int3", (False, False)), ("int2", (False, False)),
    ("fp16", (False, False)), (MIXED, (False, False)),
    ("int4", (True, True)), ("int3", (True, False)), (MIXED, (False, True)),  # rotation: only below INT8
])
def test_matches_materialize_per_precision(precision, rotated):
    layer = KVGuardLayer(precision, CFG)
    layer.set_rotation(*rotated)
    originals = filled(layer, 90, batch=1)  # batch 1: the interpreter is slow (the other tests take batch 2)
    q = query(batch=1)
    out, expected = run_kernel(layer, q, split_tokens=64)  # 2 splits of the 80-token run
    if precision == "fp16":
        assert (out - expected).abs().max().item() < TOL
        return
    assert_close_and_quantized(out, expected, layer, q, originals)


def test_several_runs_rotation_overlay_and_new_tokens_with_a_causal_mask():
    layer = KVGuardLayer("int4", CFG)
    keys, values = kv(200, 3)
    layer.update(keys[..., :60, :], values[..., :60, :])
    layer.set_precision(("int2", "int8", "int3"))
    layer.set_rotation(True, True)
    layer.update(keys[..., 60:130, :], values[..., 60:130, :])
    layer.set_precision("int3")
    layer.set_rotation(False, True)
    layer.update(keys[..., 130:, :], values[..., 130:, :])
    assert len(layer.store.runs) == 3
    # Full-precision K/V at quantized positions of every run, and at a sink and a window position.
    pos = torch.tensor([1, 10, 11, 75, 150, 190, 197], device=DEVICE)
    fresh_k, fresh_v = kv(len(pos), 4)
    layer.write_fp(pos, fresh_k, fresh_v)
    assert layer.overlay_positions().tolist() == [10, 11, 75, 150]  # 1 is a sink, 190 and 197 in the window
    t_q, stored = 9, layer.stored_tokens  # 2 x 9 query rows: the kernel's row block grows to 32
    new_k, new_v = kv(t_q, 5)
    mask = torch.zeros(1, 1, t_q, stored + t_q, device=DEVICE)
    mask[..., stored:] = torch.triu(torch.full((t_q, t_q), torch.finfo(torch.float32).min, device=DEVICE), diagonal=1)
    q = query(t_q)
    out, expected = run_kernel(layer, q, keys=new_k, values=new_v, mask=mask)  # one split: tiles of 64 in a loop
    originals = (keys.index_copy(2, pos, fresh_k), values.index_copy(2, pos, fresh_v))
    assert_close_and_quantized(out, expected, layer, q, originals, (new_k, new_v), mask)


def test_padded_batch_masks_per_row_and_per_head():
    layer = KVGuardLayer(("int4", "int3", "int2"), CFG)
    originals = filled(layer, 100)
    stored, minimum = layer.stored_tokens, torch.finfo(torch.float32).min
    mask = torch.zeros(B, H * REP, 1, stored, device=DEVICE)
    mask[1, :, :, :37] = minimum  # row 1 is left-padded: its sinks and part of the run are padding
    mask[0, 3, :, 50:70] = minimum  # any additive bias, per head
    q = query()
    out, expected = run_kernel(layer, q, mask=mask, split_tokens=64)
    assert_close_and_quantized(out, expected, layer, q, originals, mask=mask)
    boolean, _ = run_kernel(layer, q, mask=mask == 0, split_tokens=64)
    assert (boolean - expected).abs().max() < TOL


def test_sliding_layer_with_its_window_mask():
    window = 50
    layer = KVGuardSlidingLayer("int4", CFG, sliding_window=window)
    originals = filled(layer, 150, chunk=7)
    kv_len, offset = layer.get_mask_sizes(1)
    assert offset > 0 and len(layer.store.runs) == 1  # whole groups dropped from the front
    keys_at = torch.arange(offset, offset + kv_len, device=DEVICE)
    mask = torch.where(layer.length - keys_at < window, 0.0, torch.finfo(torch.float32).min).view(1, 1, 1, -1)
    new_k, new_v = kv(1, 6)
    q = query()
    out, expected = run_kernel(layer, q, keys=new_k, values=new_v, mask=mask)
    assert_close_and_quantized(out, expected, layer, q, originals, (new_k, new_v), mask)


def test_scaling_softcap_and_calibrated_int8_scales():
    layer = KVGuardLayer(("int8", "int4", "int8"), CacheConfig(residual=8, sinks=2, group_size=8))  # fp16 storage
    keys, _ = kv(40, 8)
    absmax = keys.abs().amax((0, 2))  # [H, D]
    layer.set_static_scales(absmax, absmax * 1.5)
    originals = filled(layer, 90)
    q = query(2)
    out, expected = run_kernel(layer, q, scaling=0.3, softcap=1.5)
    assert_close_and_quantized(out, expected, layer, q, originals, scaling=0.3, softcap=1.5)
    assert (out - run_kernel(layer, q)[0]).abs().max() > 100 * TOL  # the scaling and the cap are applied


# ------------------------------------------------------------------------------------------------ launches
@pytest.mark.parametrize("launch", [
    ta.Launch(block_n=64, num_warps=4, num_stages=None, programs_per_sm=2, broadcast_limit=0),  # tl.dot, 16 rows
    ta.Launch(num_stages=2, broadcast_limit=1 << 20),  # broadcast products over the 4 rows
    ta.Launch(block_n=128, num_warps=4, programs_per_sm=16),
])
def test_every_launch_configuration_computes_the_same_attention(monkeypatch, launch):
    monkeypatch.setattr(ta, "LAUNCH", launch)
    layer = KVGuardLayer(("int4", "int3", "int2"), CFG)
    layer.set_rotation(True, False)
    originals = filled(layer, 200)
    mask = torch.zeros(B, H * REP, 2, layer.stored_tokens, device=DEVICE)
    mask[1, :, :, :37] = torch.finfo(torch.float32).min  # row 1 left-padded
    q = query(2)  # 2 query tokens x 2 heads per KV head: 4 rows
    out, expected = run_kernel(layer, q, mask=mask, scaling=0.2, softcap=2.0, split_tokens=64)
    assert_close_and_quantized(out, expected, layer, q, originals, mask=mask, scaling=0.2, softcap=2.0)


# ------------------------------------------------------------------------------------------------ refusals
def test_refuses_cpu_outside_the_interpreter_and_bad_shapes(monkeypatch):
    layer = KVGuardLayer("int4", CFG)
    filled(layer, 40)
    with pytest.raises(ValueError, match="multiple of the layer's KV heads"):
        ta.decode_attention(layer.stored_read(), torch.zeros(B, 4, 1, D, device=DEVICE))
    with pytest.raises(ValueError, match="attention_mask must be"):
        ta.decode_attention(layer.stored_read(), query(), attention_mask=torch.zeros(1, 1, 1, 5, device=DEVICE))
    on_cpu = KVGuardLayer("int4", CFG)
    on_cpu.update(*kv(40, 0, device=torch.device("cpu")))
    monkeypatch.setattr(ta, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ta.decode_attention(on_cpu.stored_read(), query().cpu())


def test_without_triton_the_module_says_what_to_install_and_nothing_else_imports_it(monkeypatch):
    src = Path(ta.__file__).parent
    importers = [p.name for p in src.rglob("*.py") if re.search(r"^\s*(import|from) triton\b", p.read_text(), re.M)]
    assert importers == ["triton_attention.py"]  # so kvguard itself imports without Triton
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("kvguard_triton_probe", ta.__file__)
    with pytest.raises(ImportError, match="pip install triton=="):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
