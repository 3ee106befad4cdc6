"""``omni-async serve-ray``: the OpenAI server as N replicas on Ray Serve (extra ``[ray]``).

Kept apart from :mod:`omni_async.cli` so the command line imports Ray only when this
command runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .. import errors
from ..cli_options import add_model_flags, engine_limits, env_default, port_number

__all__ = ["add_parser", "run_command"]


def add_parser(sub: Any, fmt: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    """Add ``serve-ray`` to the command line's subparsers."""
    p = sub.add_parser("serve-ray", help="the OpenAI-compatible server as replicas on Ray Serve (extra [ray])", formatter_class=fmt)
    add_model_flags(p)
    p.add_argument("--host", default=env_default("host", "127.0.0.1"), help="Serve's HTTP proxy address [env OMNI_ASYNC_HOST]")
    p.add_argument("--port", type=port_number, default=env_default("port", 8000, port_number), help="Serve's HTTP proxy port [env OMNI_ASYNC_PORT]")
    p.add_argument("--served-model-name", default=None, help="the model id clients send; None: what --model names")
    p.add_argument("--replicas", type=int, default=1, help="engine replicas (one GPU each with --device cuda)")
    p.add_argument(
        "--autoscaling", default=None, metavar="JSON",
        help='Serve autoscaling instead of a fixed count, e.g. \'{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 64}\'',
    )
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="logical CPUs Ray reserves for each replica")
    p.add_argument("--max-ongoing-requests", type=int, default=1024, help="requests Serve lets in flight at one replica")
    p.add_argument("--address", default=None, help="a running Ray cluster to join (e.g. 'auto'); None: start Ray on this machine")
    p.set_defaults(command_parser=p)
    return p


def run_command(args: argparse.Namespace) -> int:
    """Deploy, then block until Ctrl-C or SIGTERM; Serve and (if started here) Ray are shut
    down, with later signals ignored while they are, and one line says so."""
    from .listen import listening_socket

    try:  # Serve's proxy binds the port itself; a port in use is refused before Ray starts
        listening_socket(args.host, args.port).close()
    except errors.ConfigError as exc:
        print(f"error: ConfigError: {exc}", file=sys.stderr)
        return 2
    try:
        import ray
        from ray import serve

        from .ray_serve import ReplicaOptions, build_app, run
    except ImportError as exc:
        print(f"error: ConfigError: omni-async serve-ray needs the ray extra (pip install -e '.[ray]' in the checkout, or bash scripts/install_scale.sh): {exc}", file=sys.stderr)
        return 2
    autoscaling = json.loads(args.autoscaling) if args.autoscaling else None
    options = ReplicaOptions(
        replicas=args.replicas, autoscaling=autoscaling, cpus=args.cpus_per_replica, max_ongoing_requests=args.max_ongoing_requests
    )
    engine_kwargs: dict[str, Any] = {
        "device": args.device, "loop": args.loop, "backend": args.backend, "dtype": args.dtype, "seed": args.engine_seed, **engine_limits(args),
    }
    ray.init(address=args.address, include_dashboard=False)
    try:
        app = build_app(args.model, options=options, model_name=args.served_model_name, **engine_kwargs)
        run(app, host=args.host, port=args.port)
        name = args.served_model_name or args.model
        print(f"serving {name} at http://{args.host}:{args.port}/v1 (Ctrl-C to stop); {autoscaling or args.replicas} replica(s)", file=sys.stderr, flush=True)
        _wait()
    except KeyboardInterrupt:
        pass
    finally:
        _ignore_signals()  # a second Ctrl-C must not cut the shutdown with a traceback
        serve.shutdown()
        ray.shutdown()
    print("stopped: Serve and its replicas shut down (open requests aborted)", file=sys.stderr, flush=True)
    return 0


def _ignore_signals() -> None:
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _wait() -> None:
    """Block the main thread until Ctrl-C or SIGTERM (Serve runs in Ray's processes);
    both end in the caller's shutdown of Serve and Ray."""
    import signal
    import threading

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    threading.Event().wait()
