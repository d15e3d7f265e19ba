"""The ``kvguard`` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvguard import __version__

DEFAULT_METHODS = "fp16,int8,int4,int2,kivi-4,kivi-2,hf-quanto-4,hf-quanto-2,hf-hqq-4"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def cmd_models(args: argparse.Namespace) -> int:
    from kvguard import models

    rows = []
    for name, info in models.EMBEDDED.items():
        try:
            arch = models.describe(name)
        except models.ModelNotFoundError as err:
            rows.append([name, "not installed", "-", "-", "-", "-", str(err).split("; ")[-1]])
            continue
        converted = "yes" if (models.converted_dir(name) / "config.json").is_file() else "no (first load converts)"
        rows.append([
            name, arch.model_type, str(arch.num_layers), f"{arch.num_query_heads} / {arch.num_kv_heads}",
            str(arch.head_dim), arch.layer_type_summary() + (f" (window {arch.sliding_window})" if arch.sliding_window else ""),
            converted,
        ])
    _print_table(["model", "type", "layers", "query / KV heads", "head_dim", "attention layers", "converted"], rows)
    print(f"\nconverted models live under {models.kvguard_home() / 'models'} (set KVGUARD_HOME to move them)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """The main job: decode through the quantized cache and show memory saved and quality kept."""
    import torch
    from transformers import TextStreamer

    from kvguard import data, evaluate, models
    from kvguard.cache import KVGuardCache

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = models.load(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s "
          f"(fingerprint {models.fingerprint(model)[:19]}...)", flush=True)

    doc = data.documents("prose", "eval", limit=1, max_chars=1500)[0]
    question = f"Summarize this article in two sentences.\n\n{doc.text}"
    if tok.chat_template:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    else:
        prompt = question + "\n\nSummary:"
    inputs = tok(prompt, return_tensors="pt", add_special_tokens=not tok.chat_template)
    cache = KVGuardCache(model.config, args.precision)
    print(f"\n--- generating through an all-{args.precision} KVGuardCache "
          f"(prompt: {inputs.input_ids.shape[1]} tokens, from eval article {doc.doc_id!r}) ---", flush=True)
    t0 = time.perf_counter()
    out = model.generate(**inputs, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False,
                         streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    new = out.shape[1] - inputs.input_ids.shape[1]
    dt = time.perf_counter() - t0
    print(f"--- {new} tokens in {dt:.1f} s ({new / dt:.1f} tok/s); KV cache {_fmt_bytes(cache.nbytes())} "
          f"vs {_fmt_bytes(cache.fp16_nbytes())} in FP16: {100 * (1 - cache.bytes_ratio()):.1f} % saved ---\n")

    print(f"evaluation: {args.tokens} tokens of held-out Wikipedia text, decoded token by token through each cache "
          f"(static methods by the exact parallel simulation), side by side with transformers' own quantized caches",
          flush=True)
    ids = data.token_stream("prose", "eval", tok, args.tokens)
    rows = evaluate.evaluate_stream(model, ids, "prose", _csv(args.methods))
    print(evaluate.markdown_table(rows))
    return 0


def _csv(text: str, kind=str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def cmd_eval(args: argparse.Namespace) -> int:
    """Methods side by side on the same tokens: perplexity task, pass-key retrieval, or decode speed."""
    from kvguard import data, evaluate, methods, models, passkey, speed

    from kvguard.profile import Profile, ProfileError

    names = _csv(args.methods)
    if args.profile and "kvguard" not in names:
        names.append("kvguard")
    try:
        profile = Profile.load(args.profile) if args.profile else None
        for name in names:
            methods.get(name, profile)
    except (ValueError, ProfileError) as err:
        print(f"kvguard eval: error: {err}", file=sys.stderr)
        return 2

    if args.task == "speed":
        rows = speed.run(args.model, names, _csv(args.contexts, int), args.new_tokens, profile_path=args.profile)
        print(speed.markdown_table(rows))
        if args.json:
            evaluate.write_json(args.json, {"model": args.model, "task": "speed", "new_tokens": args.new_tokens, "results": rows})
        return 0

    model, tok = models.load(args.model)
    if profile is not None:
        try:
            profile.check_model(model)
        except ProfileError as err:
            print(f"kvguard eval: error: {err}", file=sys.stderr)
            return 2
    if args.task == "passkey":
        results = []
        for name in ["fp16"] + [n for n in names if n != "fp16"]:
            results += passkey.run(model, tok, methods.get(name, profile), _csv(args.lengths, int), _csv(args.depths, float), args.trials)
        print("| method | length | depth | accuracy | trials |\n|---|---|---|---|---|")
        for r in results:
            print(f"| {r.method} | {r.length} | {r.depth} | {r.accuracy:.2f} | {r.trials} |")
        if args.json:
            evaluate.write_json(args.json, {"model": args.model, "task": "passkey",
                                            "results": [dict(vars(r), accuracy=r.accuracy) for r in results]})
        return 0

    if args.windows < 1:
        print(f"kvguard eval: error: --windows must be >= 1, got {args.windows}", file=sys.stderr)
        return 2
    if args.text_file:
        streams = {os.path.basename(args.text_file): [data.load_text_file(args.text_file, tok, args.tokens)]}
    else:
        streams = {c: _windows(data.token_stream(c, "eval", tok, args.tokens * args.windows), args.tokens, tok)
                   for c in _csv(args.corpus)}
    rows = []
    for corpus, windows in streams.items():
        per_window = [evaluate.evaluate_stream(model, ids, corpus, names, chunk=args.chunk, simulate=args.simulate,
                                               profile=profile) for ids in windows]
        rows += per_window[0] if len(per_window) == 1 else evaluate.combine_windows(per_window)
    print(evaluate.markdown_table(rows))
    if args.json:
        tokens = max(w.numel() for ws in streams.values() for w in ws)
        payload = evaluate.rows_payload(args.model, tokens, args.chunk, rows)
        payload["windows"] = args.windows
        evaluate.write_json(args.json, payload)
    return 0


def _windows(stream, tokens: int, tok) -> list:
    """Consecutive ``tokens``-long windows of ``stream``; every window starts with BOS when the model wants
    one (the stream has it only at its start)."""
    from kvguard import data

    windows = [stream[i:i + tokens].clone() for i in range(0, stream.numel(), tokens)]
    if data.wants_bos(tok) and tok.bos_token_id is not None:
        for w in windows[1:]:
            w[0] = tok.bos_token_id
    return windows


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Model-specific calibration: statistics, sensitivity, hierarchical search, profile."""
    from kvguard.calibrate import CalibrationConfig, calibrate, refit_monitor
    from kvguard.distributed import RayConfig, RayUnavailableError
    from kvguard.profile import ProfileError
    from kvguard.search import Objective

    if args.monitor_only:
        try:
            refit_monitor(args.out)
        except (ValueError, ProfileError) as err:
            print(f"kvguard calibrate: error: {err}", file=sys.stderr)
            return 2
        return 0

    try:
        objective = Objective(args.alpha, args.beta, args.gamma, args.max_ppl_increase,
                              None if args.memory_budget <= 0 else args.memory_budget)
        cfg = CalibrationConfig(args.model, args.out, args.samples, tuple(_csv(args.domains)), args.max_tokens,
                                args.batch_size, args.heldout_tokens, args.context, args.head_layers,
                                seed=args.seed, objective=objective)
        if args.ray is None and (args.ray_workers is not None or args.ray_threads != 1):
            raise ValueError("--ray-workers and --ray-threads need --ray")
        ray = None if args.ray is None else RayConfig(args.ray, args.ray_workers, args.ray_threads)
    except ValueError as err:
        print(f"kvguard calibrate: error: {err}", file=sys.stderr)
        return 2
    try:
        calibrate(cfg, resume=args.resume, ray=ray)
    except (ValueError, RayUnavailableError) as err:
        print(f"kvguard calibrate: error: {err}", file=sys.stderr)
        return 2
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Plots and an HTML page for a calibration profile."""
    from kvguard import report
    from kvguard.profile import Profile, ProfileError

    try:
        profile = Profile.load(args.profile)
    except ProfileError as err:
        print(f"kvguard report: error: {err}", file=sys.stderr)
        return 2
    page = report.write(profile, args.out)
    print(f"report written to {page}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Greedy decoding under the feedback loop: the text, then what the loop saw and did."""
    from kvguard import methods, models
    from kvguard.profile import Profile, ProfileError

    if args.max_new_tokens < 1:
        print(f"kvguard generate: error: --max-new-tokens must be >= 1, got {args.max_new_tokens}", file=sys.stderr)
        return 2
    if not args.prompt.strip():
        print("kvguard generate: error: --prompt is empty", file=sys.stderr)
        return 2
    try:
        profile = Profile.load(args.profile)
        method = methods.get(methods.LIVE if args.plan == "profile" else f"{methods.LIVE}:{args.plan}", profile)
    except (ValueError, ProfileError) as err:
        print(f"kvguard generate: error: {err}", file=sys.stderr)
        return 2
    model, tok = models.load(args.model)
    try:
        profile.check_model(model)
    except ProfileError as err:
        print(f"kvguard generate: error: {err}", file=sys.stderr)
        return 2
    if args.events:
        open(args.events, "w").close()  # one run's events per file
    if tok.chat_template and not args.raw:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    else:
        ids = tok(args.prompt, return_tensors="pt").input_ids[0]
    session = method.session(model, events_path=args.events)
    printed = ""
    generated: list[int] = []

    def show(token: int) -> None:
        nonlocal printed
        generated.append(token)
        text = tok.decode(generated, skip_special_tokens=True)
        print(text[len(printed):], end="", flush=True)
        printed = text

    t0 = time.perf_counter()
    session.generate(ids, args.max_new_tokens, eos_token_id=tok.eos_token_id, on_token=show)
    dt = time.perf_counter() - t0
    summary = session.summary()
    a, acts = summary["alarms"], summary["actions"]
    print(f"\n\n--- {len(generated)} tokens in {dt:.1f} s ({len(generated) / dt:.1f} tok/s), prompt {ids.numel()} tokens, "
          f"plan {args.plan} ---")
    print(f"memory: KV cache {_fmt_bytes(summary['kv_bytes'])} vs {_fmt_bytes(summary['kv_bytes_fp16'])} in FP16: "
          f"{100 * summary['memory_saved']:.1f} % saved")
    print(f"monitor: {summary['monitoring_steps']} steps, trigger rate {100 * summary['trigger_rate']:.1f} %; alarms: "
          f"{a['warning']} warning, {a['trigger']} trigger, {a['severe']} severe")
    print(f"compensation: {acts.get('light', 0)} light, {acts.get('heavy', 0)} heavy, "
          f"{summary['recomputed_positions']} positions recomputed ({summary['recompute_ms']:.0f} ms); precision "
          f"{acts.get('precision_up', 0)} up / {acts.get('precision_down', 0)} down")
    print(f"rollback: level {summary['level']} now, {summary['max_level']} at most"
          + ("; recalibration recommended" if summary["recalibration_recommended"] else ""))
    if args.events:
        print(f"events: {len(session.events)} written to {args.events}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """OpenAI-compatible HTTP server (:mod:`kvguard.serve`)."""
    from kvguard.profile import ProfileError
    from kvguard.serve import ServeConfig, serve

    try:
        cfg = ServeConfig(args.model, args.profile, args.host, args.port, args.api_key, args.max_concurrency,
                          args.max_queue, args.max_prompt_tokens, args.max_new_tokens, args.torch_threads, args.log_file)
        serve(cfg)
    except (ValueError, ProfileError, OSError) as err:
        print(f"kvguard serve: error: {err}", file=sys.stderr)
        return 2


def cmd_export(args: argparse.Namespace) -> int:
    """A profile's calibrated ranges as the FP8 KV-cache scales vLLM or SGLang loads."""
    from kvguard import export
    from kvguard.fp8 import describe
    from kvguard.profile import Profile, ProfileError

    try:
        spec = export.ExportSpec(args.format, args.granularity)
        profile = Profile.load(args.profile)
        manifest = export.export(profile, spec, args.out, force=args.force)
    except (ValueError, ProfileError) as err:
        print(f"kvguard export: error: {err}", file=sys.stderr)
        return 2
    print(f"{spec.format.value} export of {manifest['model']['name']} (fingerprint "
          f"{manifest['model']['fingerprint'][:19]}...) written to {args.out}: {', '.join(manifest['files'])}")
    print(describe(spec.scales(profile)))
    if spec.format is export.ExportFormat.SGLANG and manifest["plan_fp16_layers"]:
        print(f"note: SGLang quantizes every layer; the plan's FP16 layers {manifest['plan_fp16_layers']} are FP8 there")
    print(f"engine arguments: {' '.join(manifest['engine_args'])} (see {os.path.join(args.out, export.README_NAME)})")
    print(f"what it will do, on CPU: kvguard eval --model {manifest['model']['name']} --profile {args.profile} "
          f"--methods fp16,kvguard,{spec.eval_method}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvguard",
        description="Calibrated KV-cache quantization for LLM inference, with real-time error compensation.",
    )
    parser.add_argument("--version", action="version", version=f"kvguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("models", help="list the embedded models and their attention layout")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("run", help="main job: generate through the quantized cache, show memory saved and quality")
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local model folder (default: %(default)s)")
    p.add_argument("--precision", default="int4", choices=["fp16", "int8", "int4", "int2"],
                   help="cache precision for the generation demo (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=1024, help="held-out tokens for the evaluation table (default: %(default)s)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="methods in the evaluation table (default: %(default)s)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("eval", help="quality, memory and speed through the cache, side by side with peers")
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local model folder (default: %(default)s)")
    p.add_argument("--profile", help="calibration profile (for the kvguard / kvguard-live / fp8 methods)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated methods (default: %(default)s)")
    p.add_argument("--task", default="ppl", choices=["ppl", "passkey", "speed"], help="what to measure (default: %(default)s)")
    p.add_argument("--corpus", default="prose", help="comma-separated eval corpora: prose, code, dialog, long (default: %(default)s)")
    p.add_argument("--text-file", help="evaluate this UTF-8 text file instead of a corpus")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per text (default: %(default)s)")
    p.add_argument("--windows", type=int, default=1,
                   help="score this many consecutive --tokens windows per corpus and combine them (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=1, help="tokens per forward pass; 1 = true decoding (default: %(default)s)")
    p.add_argument("--simulate", default="auto", choices=["auto", "on", "off"],
                   help="score static methods by the exact parallel simulation of chunk-1 decoding (default: %(default)s)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--lengths", default="1024,2048,4096", help="passkey: prompt lengths (default: %(default)s)")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="passkey: needle depths (default: %(default)s)")
    p.add_argument("--trials", type=int, default=3, help="passkey: prompts per length and depth (default: %(default)s)")
    p.add_argument("--contexts", default="1024,4096", help="speed: context lengths (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="speed: decode steps timed (default: %(default)s)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("calibrate", help="model-specific calibration: statistics, sensitivity, mixed-precision plan, profile")
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local model folder (default: %(default)s)")
    p.add_argument("--out", required=True, help="profile directory to write")
    p.add_argument("--samples", type=int, default=5000, help="calibration samples, mixed over the domains (default: %(default)s)")
    p.add_argument("--domains", default="prose,dialog,code", help="calibration domains (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=1.0, help="score weight of memory (bytes / FP16) (default: %(default)s)")
    p.add_argument("--beta", type=float, default=0.2, help="score weight of latency (decode time / FP16) (default: %(default)s)")
    p.add_argument("--gamma", type=float, default=5.0,
                   help="score weight of the perplexity penalty: the increase in %% the held-out KL predicts "
                        "(default: %(default)s)")
    p.add_argument("--max-ppl-increase", type=float, default=1.0,
                   help="largest perplexity increase in %% on held-out calibration text, worst domain (default: %(default)s)")
    p.add_argument("--memory-budget", type=float, default=0.40,
                   help="largest KV bytes as a fraction of FP16 at --context tokens; 0 for none (default: %(default)s)")
    p.add_argument("--context", type=int, default=2048, help="context length the memory is measured at (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per calibration sample (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per statistics batch (default: %(default)s)")
    p.add_argument("--heldout-tokens", type=int, default=1536,
                   help="held-out calibration tokens (split over the domains) that score candidates (default: %(default)s)")
    p.add_argument("--head-layers", type=int, default=4, help="most sensitive layers also measured per KV head (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its last finished stage")
    p.add_argument("--monitor-only", action="store_true",
                   help="recalibrate only the run-time monitor of the existing profile at --out (plan and statistics kept)")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run statistics, sensitivity and search on Ray (same profile, bit for bit): alone, a private "
                        "Ray on this machine; or a cluster address (auto, HOST:6379, ray://HOST:10001). Needs "
                        "pip install 'kvguard[ray]'")
    p.add_argument("--ray-workers", type=int, metavar="N", help="Ray workers, each loading the model once (default: the cluster's CPUs / --ray-threads)")
    p.add_argument("--ray-threads", type=int, default=1, metavar="T", help="torch threads (and Ray CPUs) per Ray worker (default: %(default)s)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("report", help="plots and an HTML page for a calibration profile")
    p.add_argument("--profile", required=True, help="profile directory (from `kvguard calibrate`)")
    p.add_argument("--out", required=True, help="directory for the PNG plots and index.html")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("generate", help="decode with live entropy monitoring and compensation")
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local model folder (default: %(default)s)")
    p.add_argument("--profile", required=True, help="calibration profile of the model (from `kvguard calibrate`)")
    p.add_argument("--prompt", required=True, help="the prompt (sent as a user message when the model has a chat template)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default: %(default)s)")
    p.add_argument("--events", help="write every alarm and action as one JSON line to this file")
    p.add_argument("--plan", default="profile",
                   help="plan new tokens start from: the profile's, or a static method such as int4 (default: %(default)s)")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server: every request under the feedback loop, "
                                      "Prometheus metrics")
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local model folder (default: %(default)s)")
    p.add_argument("--profile", required=True, help="calibration profile of the model (from `kvguard calibrate`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("KVGUARD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /healthz (default: $KVGUARD_API_KEY)")
    p.add_argument("--max-concurrency", type=int, default=4, help="requests decoding at once (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=32,
                   help="requests waiting for a worker; beyond, 429 (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="longest prompt accepted (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=512,
                   help="most tokens one request may generate (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch threads; 0: the cores shared among the workers (default: %(default)s)")
    p.add_argument("--log-file", help="append the JSON log lines here instead of stderr")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("export", help="calibrated FP8 KV-cache scales for vLLM / SGLang")
    p.add_argument("--profile", required=True, help="calibration profile (from `kvguard calibrate`)")
    p.add_argument("--format", required=True, choices=["vllm", "sglang"], help="serving engine")
    p.add_argument("--out", required=True, help="directory to write (a previous export there is replaced)")
    p.add_argument("--granularity", default="tensor", choices=["tensor", "head"],
                   help="one scale per layer (tensor) or per layer and KV head (head, vllm only) (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="replace --out even if it holds other files (they are deleted)")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    from kvguard.data import CorpusNotInstalledError
    from kvguard.models import ModelNotFoundError

    try:
        return args.func(args)
    except (ModelNotFoundError, CorpusNotInstalledError) as err:
        print(f"kvguard: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
