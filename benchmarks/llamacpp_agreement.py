"""How closely llama.cpp's own FP16 cache agrees with kvguard's ``fp16`` on the same tokens, and how llama.cpp's
chunk (its ubatch) changes its scores: the figures quoted in ``kvguard.peers.llamacpp``'s docstring.

    .venv/bin/python benchmarks/llamacpp_agreement.py > benchmarks/results/smollm2-135m-llamacpp-agreement.txt

SmolLM2, eval prose, 256 and 2,048 tokens, one thread (llama.cpp's threads spin at barriers on shared cores).
"""

import torch

from kvguard import data, models
from kvguard.architecture import Architecture
from kvguard.peers import llamacpp
from kvguard.plan import Plan
from kvguard.scoring import score_simulated


def main() -> None:
    torch.set_num_threads(1)
    model, tok = models.load("smollm2-135m")
    gguf = models.gguf_path("smollm2-135m")
    f16_spec = llamacpp.SPECS["llamacpp-f16"]
    plan = Plan.uniform(Architecture.from_config(model.config), "fp16")
    for n in (256, 2048):
        ids = data.token_stream("prose", "eval", tok, n)
        ours = score_simulated(model, ids, plan, keep_logits=True)
        f16 = llamacpp.score(gguf, ids, f16_spec, chunk=1, reference=torch.log_softmax(ours.logits, dim=-1))
        print(f"tokens={n} kvguard_fp16_ppl={ours.perplexity:.4f} llamacpp_f16_ppl={f16.perplexity:.4f} "
              f"delta={100 * (f16.perplexity / ours.perplexity - 1):+.3f}% kl={f16.kl:.5f} top1={f16.top1_agree:.4f}",
              flush=True)
        if n == 256:
            for chunk in (32, 64):
                s = llamacpp.score(gguf, ids, f16_spec, chunk=chunk)
                print(f"tokens={n} chunk={chunk} ppl={s.perplexity:.4f} "
                      f"vs_chunk1={100 * (s.perplexity / f16.perplexity - 1):+.3f}%", flush=True)


if __name__ == "__main__":
    main()
