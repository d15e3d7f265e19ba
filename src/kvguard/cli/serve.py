"""``kvguard serve``: the OpenAI-compatible HTTP server (:mod:`kvguard.serving`)."""

from __future__ import annotations

import argparse
import os

from kvguard.cli.common import add_device, add_model, default, device


def add_parser(sub) -> None:
    from kvguard.serving.settings import ServeConfig as S

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server: requests batched into one forward per step, "
                                      "each under its own feedback loop, Prometheus metrics")
    add_model(p)
    add_device(p)
    p.add_argument("--profile", required=True, help="calibration profile of the model (from `kvguard calibrate`)")
    p.add_argument("--host", default=default(S, "host"), help="address to listen on (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=default(S, "port"), help="port (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("KVGUARD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /healthz (default: $KVGUARD_API_KEY)")
    p.add_argument("--max-batch", type=int, default=default(S, "max_batch"),
                   help="requests decoded together, one model forward per step for all of them; 1: one at a time "
                        "(default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=default(S, "max_queue"),
                   help="requests waiting for KV memory or a place in the batch; beyond, 429 (default: %(default)s)")
    p.add_argument("--kv-budget", default=default(S, "kv_budget"),
                   help="KV bytes the requests in flight may hold: bytes (2GiB, 512MiB) or a fraction of RAM "
                        "(default: %(default)s)")
    p.add_argument("--step-tokens", type=int, default=default(S, "step_tokens"),
                   help="tokens one forward feeds at most: every decoding request's next token, then prompt chunks "
                        "(default: %(default)s)")
    p.add_argument("--plan", default=default(S, "plan"),
                   help="what each request's cache stores: 'profile', 'kvguard@<bytes ratio>' (a frontier plan of the "
                        "profile) or fp16 / int8 / int4 / int3 / int2 everywhere (default: %(default)s)")
    p.add_argument("--no-loop", dest="loop", action="store_false",
                   help="serve the plan's cache alone, without the feedback loop")
    p.add_argument("--read-timeout", type=float, default=default(S, "read_timeout"),
                   help="seconds a client may take to send its request body; beyond, 408 (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=default(S, "max_prompt_tokens"),
                   help="longest prompt accepted (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=default(S, "max_new_tokens"),
                   help="most tokens one request may generate (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=default(S, "torch_threads"),
                   help="torch threads; 0: the cores shared among the workers (default: %(default)s)")
    p.add_argument("--log-file", help="append the JSON log lines here instead of stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.cli.common import writable_file
    from kvguard.serving.app import serve
    from kvguard.serving.settings import ServeConfig

    writable_file("--log-file", args.log_file)
    serve(ServeConfig(args.model, args.profile, host=args.host, port=args.port, api_key=args.api_key,
                      max_batch=args.max_batch, max_queue=args.max_queue, kv_budget=args.kv_budget,
                      step_tokens=args.step_tokens, plan=args.plan, loop=args.loop,
                      max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                      torch_threads=args.torch_threads, log_file=args.log_file, device=device(args),
                      read_timeout=args.read_timeout))
    return 0
