"""Loads a served model folder in vLLM and reports what the engine holds, as one JSON line on stdout.

Run by :mod:`kvguard.export.engine_check` with the python of the venv vLLM is installed in (``make engines``),
never imported by kvguard: it needs only vLLM and the standard library. ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
keeps vLLM's engine core in this process, so the model object is reachable: the scales are read from every
attention layer right after the weights are loaded (``load_model`` is wrapped), before vLLM allocates its KV
cache, which is where vLLM's CPU build refuses an FP8 cache on x86 without AVX-512 / AMX. When the engine does
start and a token file is given, it scores those tokens teacher-forced (``prompt_logprobs``).

Usage: ``python vllm_probe.py MODEL_DIR [--tokens FILE.json] [--max-model-len N] [--memory-fraction F]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

_LAYER = re.compile(r"layers\.(\d+)\.")


def _attention_layers(model) -> dict:
    from vllm.model_executor.layers.attention import Attention

    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            index = _LAYER.search(module.layer_name)
            layers[int(index.group(1)) if index else name] = {
                "name": module.layer_name,
                "k_scale": module._k_scale.detach().float().reshape(-1).tolist(),
                "v_scale": module._v_scale.detach().float().reshape(-1).tolist(),
                "kv_cache_dtype": module.kv_cache_dtype,
            }
    return layers


def _watch_loading(found: dict) -> None:
    """Wrap the model runners' ``load_model`` so the loaded attention layers are read before anything else."""
    runners = []
    for module, cls in (("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
                        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")):
        try:
            runners.append(getattr(__import__(module, fromlist=[cls]), cls))
        except (ImportError, AttributeError):
            continue
    for runner in runners:
        original = runner.load_model

        def load_model(self, *args, _original=original, **kwargs):
            _original(self, *args, **kwargs)
            found["layers"] = _attention_layers(self.get_model())
            found["cache_dtype"] = self.vllm_config.cache_config.cache_dtype

        runner.load_model = load_model


def _score(llm, tokens: list[int]) -> dict:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    logprobs = [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], tokens[1:])]
    nll = -sum(logprobs) / len(logprobs)
    return {"tokens": len(tokens), "nll": nll, "ppl": math.exp(nll)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--tokens", help="JSON list of token ids to score teacher-forced")
    parser.add_argument("--max-model-len", type=int, default=2048)
    # On the CPU backend this is the fraction of host memory vLLM reserves (mostly for its KV cache); vLLM's
    # default (0.92) is refused on a machine that runs anything else.
    parser.add_argument("--memory-fraction", type=float, default=0.1)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    report = {"engine": "vllm", "version": None, "layers": {}, "cache_dtype": None, "error": None, "score": None}
    try:
        import torch
        import vllm

        report["version"] = vllm.__version__
        report["cpu"] = {"avx512": bool(torch.cpu._is_avx512_supported()),
                         "amx": bool(torch.cpu._is_amx_tile_supported()), "cuda": torch.cuda.is_available()}
        _watch_loading(report)
        llm = vllm.LLM(args.model_dir, max_model_len=args.max_model_len, enforce_eager=True, dtype="float32",
                       seed=0, gpu_memory_utilization=args.memory_fraction)
        if args.tokens:
            with open(args.tokens) as f:
                report["score"] = _score(llm, json.load(f))
    except Exception as err:  # the engine's refusal is the finding: report it, with whatever was read before
        report["error"] = f"{type(err).__name__}: {err}"
    print("KVGUARD_PROBE " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
