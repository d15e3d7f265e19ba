"""``kvguard serve``: the OpenAI-compatible HTTP server (:mod:`kvguard.serving`)."""

from __future__ import annotations

import argparse
import os

from kvguard.cli.common import add_device, add_model, default, device


def add_parser(sub) -> None:
    from kvguard.serving.settings import ServeConfig as S

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server: every request under the feedback loop, "
                                      "Prometheus metrics")
    add_model(p)
    add_device(p)
    p.add_argument("--profile", required=True, help="calibration profile of the model (from `kvguard calibrate`)")
    p.add_argument("--host", default=default(S, "host"), help="address to listen on (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=default(S, "port"), help="port (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("KVGUARD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /healthz (default: $KVGUARD_API_KEY)")
    p.add_argument("--max-concurrency", type=int, default=default(S, "max_concurrency"),
                   help="requests decoding at once (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=default(S, "max_queue"),
                   help="requests waiting for a worker; beyond, 429 (default: %(default)s)")
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
    serve(ServeConfig(args.model, args.profile, args.host, args.port, args.api_key, args.max_concurrency,
                      args.max_queue, args.max_prompt_tokens, args.max_new_tokens, args.torch_threads, args.log_file,
                      device(args)))
    return 0
