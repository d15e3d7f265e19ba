"""Decode attention on a GPU: the fused Triton kernel over kvguard's packed cache vs FP16 SDPA.

    .venv/bin/python benchmarks/triton_decode.py [--contexts 8192,16384,32768] [--precisions int4,int3,int2,int8]
                                                 [--batch 1] [--iters 200] [--json F]
    .venv/bin/python benchmarks/triton_decode.py --compile-only [--arch 90]     # no GPU needed

**Needs a CUDA GPU; it has not been run yet** (the machines this project runs on have none). One layer shaped like
SmolLM2-135M's (9 query / 3 KV heads, head_dim 64, group 32, 4 sinks, FP16 window 64) is filled with
``context`` random keys (per-channel outliers, as real keys have) and values, then one query token is timed (CUDA
events, median of ``--iters`` after warm-up) three ways, side by side in one process:

- ``fp16-sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over FP16 K/V of the same length (what an
  unquantized cache reads);
- ``kvguard-dequant``: what kvguard does today, ``layer.materialize()`` (the whole history dequantized) + SDPA;
- ``kvguard-triton``: :func:`kvguard.triton_attention.decode_attention`, reading the codes directly.

Columns: microseconds per call, the ratio to ``fp16-sdpa`` of the same context (below 1 is faster), the layer's
stored bytes over FP16 bytes, and the largest difference of the Triton output from ``kvguard-dequant``'s: a check
of the compiled kernel, which CI runs only in Triton's interpreter; expect float16 rounding (~1e-3), since that
path rounds the dequantized K/V and the output to float16 while the kernel computes in float32.
Attention of one layer is all that is timed: no model, no projections, no KV writes.

``--compile-only`` needs no GPU: it compiles both kernels, for every precision and with / without mask and softcap,
to a CUDA binary for ``sm_<arch>`` (Triton ships ``ptxas``), which catches what the interpreter does not check
(types, shapes, constexpr branches the compiler rejects). It does not run them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

HEADS_Q, HEADS_KV, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def filled_layer(precision: str, context: int, batch: int, device: torch.device):
    """A KVGuardLayer holding ``context`` tokens (fed in chunks, as a prefill would) and its FP16 originals."""
    from kvguard.cache_layer import KVGuardLayer
    from kvguard.config import CacheConfig

    gen = torch.Generator(device=device).manual_seed(0)
    outliers = 1 + 4 * (torch.rand(HEADS_KV, 1, HEAD_DIM, generator=gen, device=device) > 0.9)  # [H, 1, D]
    keys = torch.randn(batch, HEADS_KV, context, HEAD_DIM, generator=gen, device=device) * outliers
    values = torch.randn(batch, HEADS_KV, context, HEAD_DIM, generator=gen, device=device)
    layer = KVGuardLayer(precision, CacheConfig())  # the defaults: group 32, 4 sinks, FP16 window 64
    for start in range(0, context, 2048):
        layer.update(keys[..., start:start + 2048, :].half(), values[..., start:start + 2048, :].half())
    return layer, keys.half(), values.half()


def median_us(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def sdpa(query, keys, values):
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=True)


def measure(precision: str, context: int, batch: int, iters: int, device: torch.device) -> list[dict]:
    from kvguard.triton_attention import decode_attention

    layer, keys, values = filled_layer(precision, context, batch, device)
    query = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, device=device, dtype=torch.float16)

    def dequant():
        k, v = layer.materialize(torch.float16)
        return sdpa(query, k, v)

    def triton():
        return decode_attention(layer, query)

    diff = (triton().float() - dequant().float()).abs().max().item()
    base = median_us(lambda: sdpa(query, keys, values), iters)
    ratio = layer.nbytes() / layer.fp16_nbytes()
    rows = [dict(context=context, precision=precision, method="fp16-sdpa", us=base, vs_fp16=1.0, kv_bytes_ratio=1.0)]
    for name, fn in (("kvguard-dequant", dequant), ("kvguard-triton", triton)):
        us = median_us(fn, iters)
        rows.append(dict(context=context, precision=precision, method=name, us=us, vs_fp16=us / base,
                         kv_bytes_ratio=ratio, max_diff=diff if name == "kvguard-triton" else None))
    return rows


def compile_only(arch: int) -> int:
    """Compile the kernels for a CUDA target without a GPU; print each configuration's compile time."""
    import os
    import time

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("--compile-only needs the compiled kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvguard import triton_attention as ta

    target, options = GPUTarget("cuda", arch, 32), {"enable_fp_fusion": False}  # as the launches set it
    floats = {"scaling", "softcap"}

    def signature(fn, pointers: dict, constants: dict) -> dict:
        return {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name in floats else "i32")
                for name in fn.arg_names}

    for bits in (8, 4, 3, 2):
        codes = "*i8" if bits == 8 else "*u8"
        side = dict(codes=codes, scale="*fp16", zero="*fp16")
        for masked in (False, True):
            constants = dict(D=HEAD_DIM, BLOCK_M=16, BLOCK_N=64, K_BITS=bits, K_GT=32, K_GD=1, V_BITS=bits, V_GT=1,
                             V_GD=32, HAS_BIAS=masked, SOFTCAP=masked)
            pointers = dict(q="*fp32", out="*fp32", lse="*fp32", bias="*fp32", kc=codes, ks="*fp16", kz="*fp16",
                            vc=codes, vs="*fp16", vz="*fp16")
            fn = ta._part_attention_kernel
            start = time.perf_counter()
            triton.compile(ASTSource(fn, signature(fn, pointers, constants), constants), target, options)
            print(f"attention int{bits} mask+softcap={masked}: compiled for sm_{arch} in "
                  f"{time.perf_counter() - start:.1f} s")
        constants = dict(D=HEAD_DIM, BLOCK_N=64, BITS=bits, GT=32, GD=1)
        fn = ta._dequantize_kernel
        start = time.perf_counter()
        triton.compile(ASTSource(fn, signature(fn, dict(out="*fp32", **side), constants), constants), target, options)
        print(f"dequantize int{bits}: compiled for sm_{arch} in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,16384,32768")
    parser.add_argument("--precisions", default="int4,int3,int2,int8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json")
    parser.add_argument("--compile-only", action="store_true", help="compile the kernels for a CUDA target, no GPU")
    parser.add_argument("--arch", type=int, default=90, help="the CUDA target's compute capability for --compile-only")
    args = parser.parse_args(argv)
    if args.compile_only:
        return compile_only(args.arch)
    if not torch.cuda.is_available():
        print("triton_decode.py needs a CUDA GPU (the Triton kernel runs on CPU only in the interpreter, far too "
              "slowly to time)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for precision in args.precisions.split(","):
            print(f"[triton_decode] {precision} at {context} tokens", file=sys.stderr, flush=True)
            rows += measure(precision, context, args.batch, args.iters, device)
    print(f"\n{torch.cuda.get_device_name(device)}, batch {args.batch}, {HEADS_Q} / {HEADS_KV} heads, "
          f"head_dim {HEAD_DIM}, one query token\n")
    print("| context | precision | method | us | vs fp16-sdpa | kv_bytes_ratio | max_diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        diff = "-" if r.get("max_diff") is None else f"{r['max_diff']:.1e}"
        print(f"| {r['context']} | {r['precision']} | {r['method']} | {r['us']:.1f} | {r['vs_fp16']:.2f} "
              f"| {r['kv_bytes_ratio']:.3f} | {diff} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
