"""Decode attention on a GPU: the fused Triton kernel over kvguard's packed cache vs FP16 SDPA.

    .venv/bin/python benchmarks/triton_decode.py [--contexts 8192,16384,32768] [--precisions int4,int3,int2,int8]
                                                 [--batches 1,64] [--iters 200] [--graphs] [--sweep] [--json F]
    .venv/bin/python benchmarks/triton_decode.py --compile-only [--arch 90]     # no GPU needed

Needs a CUDA GPU (`benchmarks/gpu_checks.sh` runs it with the kernel's tests). One layer shaped like SmolLM2-135M's
(9 query / 3 KV heads, head_dim 64, group 32, 4 sinks, FP16 window 64) is filled with ``context`` random keys
(per-channel outliers, as real keys have) and values, then one query token is timed (CUDA events, median of
``--iters`` after warm-up), side by side in one process:

- ``fp16-sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over FP16 K/V of the same length (what an
  unquantized cache reads);
- ``kvguard-dequant``: what kvguard's cache does in a model, ``layer.materialize()`` (the whole history
  dequantized) + SDPA;
- ``kvguard-triton``: :func:`kvguard.triton_attention.decode_attention`, reading the codes directly;
- ``kvguard-triton-part``: the quantized part's kernel alone, with its split merge (the rest of ``kvguard-triton``
  is torch: the sinks' and window's attention and the final log-sum-exp merge, a few small launches each);
- with ``--graphs``, ``fp16-sdpa+graph`` and ``kvguard-triton+graph``: the same calls replayed from a CUDA graph,
  as engines that capture their decode step run them (the launches' CPU cost gone).

Columns: microseconds per call, the ratio to ``fp16-sdpa`` of the same context and batch (below 1 is faster), the
layer's stored bytes over FP16 bytes, and the largest difference of the Triton output from ``kvguard-dequant``'s:
a check of the compiled kernel; expect float16 rounding (~1e-3), since that path rounds the dequantized K/V and
the output to float16 while the kernel computes in float32. ``--sweep`` first times the INT4 part's kernel under
every launch configuration of ``SWEEP`` (:class:`kvguard.triton_attention.Launch`) at the largest context, then
runs the table with the best one (lowest geometric mean ratio over the batches). Attention of one layer is
all that is timed: no model, no projections, no KV writes.

``--compile-only`` needs no GPU: it compiles both kernels, for every precision and with / without mask and softcap,
to a CUDA binary for ``sm_<arch>`` (Triton ships ``ptxas``), which catches what the interpreter does not check
(types, shapes, constexpr branches the compiler rejects). It does not run them.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def graphed(fn):
    """``fn`` captured once in a CUDA graph and replayed: what a serving engine that captures its decode step
    (vLLM, SGLang) pays, the kernel launches' CPU cost gone. None when ``fn`` cannot be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as torch's docs ask before a capture
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as err:  # noqa: BLE001 - a capture failure is a result to report, not a crash
        print(f"[triton_decode] CUDA graph capture failed: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def sdpa(query, keys, values):
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=True)


def setup(precision: str, context: int, batch: int, device: torch.device):
    """A filled layer and the timed calls on it, by row name: FP16 SDPA, dequantize + SDPA, the whole Triton path,
    and the quantized part's kernel alone (with its split merge: the rest of the Triton path is the sinks, window
    and final merge in torch)."""
    from kvguard import triton_attention as ta

    layer, keys, values = filled_layer(precision, context, batch, device)
    query = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, device=device, dtype=torch.float16)
    attention = ta._Attention(query, layer.num_heads, None, HEAD_DIM ** -0.5, None, None)
    read = layer.stored_read()
    segment = next(seg for seg in read.segments if seg.quantized)  # the quantized run
    q32 = query.float()

    def dequant():
        k, v = layer.materialize(torch.float16)
        return sdpa(query, k, v)

    return layer, {
        "fp16-sdpa": lambda: sdpa(query, keys, values),
        "kvguard-dequant": dequant,
        "kvguard-triton": lambda: ta.decode_attention(layer.stored_read(), query),
        "kvguard-triton-part": lambda: attention.kernel(q32, segment, None),
    }


def measure(precision: str, context: int, batch: int, iters: int, graphs: bool, device: torch.device) -> list[dict]:
    layer, calls = setup(precision, context, batch, device)
    diff = (calls["kvguard-triton"]().float() - calls["kvguard-dequant"]().float()).abs().max().item()
    ratio = layer.nbytes() / layer.fp16_nbytes()
    timed = dict(calls)
    if graphs:
        for name in ("fp16-sdpa", "kvguard-triton"):
            replay = graphed(calls[name])
            if replay is not None:
                timed[name + "+graph"] = replay
    base = median_us(timed["fp16-sdpa"], iters)
    rows = []
    for name, fn in timed.items():
        us = base if name == "fp16-sdpa" else median_us(fn, iters)
        rows.append(dict(context=context, batch=batch, precision=precision, method=name, us=us, vs_fp16=us / base,
                         kv_bytes_ratio=1.0 if name.startswith("fp16") else ratio,
                         max_diff=diff if name == "kvguard-triton" else None))
    del layer, calls, timed  # the calls hold the K/V
    torch.cuda.empty_cache()
    return rows


# broadcast_limit 0: tl.dot always; 1 << 20: broadcast products always (for these 3 query rows per KV head).
SWEEP = [dict(block_n=n, num_warps=w, num_stages=1, programs_per_sm=p, broadcast_limit=r)
         for n in (32, 64, 128) for w in (2, 4) for p in (2, 8, 32) for r in (0, 1 << 20)]


def sweep(context: int, batch: int, iters: int, device: torch.device) -> list[dict]:
    """The INT4 part's kernel under each launch configuration of :data:`SWEEP` (tokens per tile x warps x
    programs per multiprocessor x tl.dot or broadcast products), as a ratio to FP16 SDPA."""
    from kvguard import triton_attention as ta

    layer, calls = setup("int4", context, batch, device)
    base = median_us(calls["fp16-sdpa"], iters)
    default, rows = ta.LAUNCH, []
    try:
        for config in SWEEP:
            ta.LAUNCH = ta.Launch(**config)
            us = median_us(calls["kvguard-triton-part"], iters)
            rows.append(dict(context=context, batch=batch, **config, part_us=us, vs_fp16=us / base))
            print(f"[triton_decode]   {config}: {us:.1f} us, {us / base:.2f}x fp16", file=sys.stderr, flush=True)
    finally:
        ta.LAUNCH = default
    del layer, calls
    torch.cuda.empty_cache()
    return rows


def best_launch(rows: list[dict]) -> dict:
    """The configuration with the lowest product of its ratios over the batches swept (a geometric mean)."""
    import math

    score: dict[tuple, float] = {}
    for r in rows:
        key = tuple(r[k] for k in SWEEP[0])
        score[key] = score.get(key, 0.0) + math.log(r["vs_fp16"])
    return dict(zip(SWEEP[0], min(score, key=score.get)))


def print_sweep(rows: list[dict]) -> None:
    print("\n| context | batch | block_n | num_warps | programs_per_sm | broadcast | part us | vs fp16-sdpa |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["batch"], r["part_us"])):
        print(f"| {r['context']} | {r['batch']} | {r['block_n']} | {r['num_warps']} | {r['programs_per_sm']} "
              f"| {'yes' if r['broadcast_limit'] else 'no'} | {r['part_us']:.1f} | {r['vs_fp16']:.2f} |")


def print_table(rows: list[dict], device: torch.device) -> None:
    print(f"\n{torch.cuda.get_device_name(device)}, {HEADS_Q} / {HEADS_KV} heads, head_dim {HEAD_DIM}, one query "
          f"token\n")
    print("| context | batch | precision | method | us | vs fp16-sdpa | kv_bytes_ratio | max_diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        diff = "-" if r.get("max_diff") is None else f"{r['max_diff']:.1e}"
        print(f"| {r['context']} | {r['batch']} | {r['precision']} | {r['method']} | {r['us']:.1f} "
              f"| {r['vs_fp16']:.2f} | {r['kv_bytes_ratio']:.3f} | {diff} |")


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
            constants = dict(D=HEAD_DIM, BLOCK_M=16 if masked else 4, BLOCK_N=ta.LAUNCH.block_n, K_BITS=bits,
                             K_GT=32, K_GD=1, V_BITS=bits, V_GT=1, V_GD=32, HAS_BIAS=masked, SOFTCAP=masked,
                             DOT=masked)
            pointers = dict(q="*fp32", out="*fp32", lse="*fp32", bias="*fp32", kc=codes, ks="*fp16", kz="*fp16",
                            vc=codes, vs="*fp16", vz="*fp16")
            fn = ta._part_attention_kernel
            start = time.perf_counter()
            triton.compile(ASTSource(fn, signature(fn, pointers, constants), constants), target, options)
            print(f"attention int{bits} mask+softcap+dot={masked}: compiled for sm_{arch} in "
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
    parser.add_argument("--batches", default="1", help="batch sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--graphs", action="store_true", help="also time FP16 SDPA and the Triton path replayed "
                        "from a CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="first time the INT4 kernel under every launch "
                        "configuration at the largest context, per batch; the table then runs the best")
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
    from kvguard import triton_attention as ta

    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    sweeps, chosen = [], None
    if args.sweep:  # first, so that the table below runs the best configuration
        for batch in batches:
            print(f"[triton_decode] batch {batch}: launch sweep at {max(contexts)} tokens", file=sys.stderr, flush=True)
            sweeps += sweep(max(contexts), batch, args.iters // 2, device)
        chosen = best_launch(sweeps)
        print(f"[triton_decode] best launch over the batches: {chosen}", file=sys.stderr, flush=True)
        ta.LAUNCH = ta.Launch(**chosen)
    rows = []
    for batch in batches:
        for context in contexts:
            for precision in args.precisions.split(","):
                print(f"[triton_decode] batch {batch}, {precision} at {context} tokens", file=sys.stderr, flush=True)
                rows += measure(precision, context, batch, args.iters, args.graphs, device)
                print("[triton_decode]   " + ", ".join(f"{r['method']} {r['us']:.1f} us" for r in rows[-6:]),
                      file=sys.stderr, flush=True)
    if sweeps:
        print_sweep(sweeps)
    print(f"\nlaunch: {ta.LAUNCH}")
    print_table(rows, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                       "launch": dataclasses.asdict(ta.LAUNCH), "rows": rows, "sweep": sweeps}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
