"""The ``omni-async`` command line: ``demo``, ``generate``, ``serve``, ``serve-ray``
(:mod:`omni_async.serving.ray_command`), ``pipeline-demo`` and ``speak`` (``DESCRIPTION``
is what ``--help`` says of them).

Arguments are checked before anything loads (``cli_options.preflight``), and every
failure ends as one line on stderr with exit status 2 (usage) or 1 (runtime).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator

from . import errors
from .cli_options import (
    DEFAULT_MODEL, CommandParser, add_device_flags, add_model_flags, engine_limits, env_default, parse_bool, port_number, preflight, report, sampling_of,
)
from .logs import configure_cli_logging, log
from .serving.signals import signals_noted
from .speech.flags import add_schedule_flags, add_speak_flags  # (they import no torch)
from .version import __version__

if TYPE_CHECKING:
    from .engine import Engine

DESCRIPTION = (
    "An asyncio-native scheduler for autoregressive model stages. Six commands: demo (several "
    "requests at once, streamed, with tokens/s), generate (one answer), serve (an "
    "OpenAI-compatible HTTP server; needs the serve extra; a speech model is served at "
    "/v1/audio/speech), serve-ray (that server as replicas on Ray Serve; needs the ray "
    "extra), pipeline-demo (a thinker streaming into a talker) and speak (one text spoken "
    "into a WAV file). demo, generate, serve and serve-ray run SmolLM2-135M-Instruct "
    "(smollm2) unless --model names another; pipeline-demo runs the built-in tiny models, "
    "speak the built-in tts-tiny (random weights) unless --model names a Qwen3-TTS checkpoint. "
    "Run 'omni-async COMMAND --help' for a command's flags."
)
GENERATE_KV_TOKENS = 8192  # generate's KV cache unless --kv-capacity-tokens says otherwise
DEMO_PROMPTS = [
    "The thinker writes text; the talker speaks it.",
    "Continuous batching keeps the model busy.",
    "An idle loop should cost nothing.",
    "Streams arrive token by token.",
    "Paged KV caches grow one page at a time.",
    "Abort, retract, resume.",
]
# For a real instruct model (one whose tokenizer has a chat template): questions, asked
# as chat turns.
DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Why is the sky blue? Answer in one sentence.",
    "Write a haiku about a cat.",
    "What is 12 times 12?",
    "Give one tip for writing clear code.",
]


def _add_model_args(p: argparse.ArgumentParser, default_model: str = DEFAULT_MODEL) -> None:
    add_model_flags(p, default_model)


def _share(text: str) -> float | int:
    """A memory share as typed: '0.3' is a fraction, '8000000000' bytes."""
    try:
        return int(text) if text.isdigit() else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a fraction or a byte count: {text!r}") from None


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least``."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return value

    return count


def _add_sampling_args(p: argparse.ArgumentParser, max_new: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens whose probabilities add up to this (1 keeps every token)")
    p.add_argument("--seed", type=int, default=None, help="the request's sampling seed")


async def _load(args: argparse.Namespace, defaults: dict | None = None) -> Engine:
    """Load in a worker thread (Engine.load) while the loop shows that it is working:
    a live elapsed-time line on a terminal, one line when it is done. The engine (and
    torch) is imported here, not with the module: ``--help`` and usage errors answer
    without it."""
    from .engine import Engine

    tty = sys.stderr.isatty()
    start = time.perf_counter()

    async def progress() -> None:
        from .models.gguf_cache import converting

        frames = "|/-\\"
        i = 0
        while True:
            if converting():  # the conversion reports its own progress on this line
                await asyncio.sleep(0.1)
                continue
            print(f"\rloading {args.model} {frames[i % 4]} {time.perf_counter() - start:5.1f} s", end="", file=sys.stderr, flush=True)
            i += 1
            await asyncio.sleep(0.1)

    ticker = asyncio.create_task(progress()) if tty else None
    log.info("cli_model_loading", model=args.model)
    try:
        engine = await Engine.load(
            args.model, device=args.device, loop=args.loop, backend=args.backend, dtype=args.dtype, seed=args.engine_seed, **{**(defaults or {}), **engine_limits(args)}
        )
    except BaseException:
        if tty:  # end the progress line before the error's
            print(file=sys.stderr)
        raise
    finally:
        if ticker is not None:
            ticker.cancel()
    if tty or args.command == "serve":
        print(f"\rloaded {args.model} in {time.perf_counter() - start:.1f} s" + " " * 8, file=sys.stderr)
    return engine


def _demo_header(args: argparse.Namespace, prompts: list[str]) -> None:
    """Say what the demo shows before the streams start."""
    if args.model == "tiny":
        print(
            "Model: tiny, built in, with RANDOM weights: its text is noise. The demo shows the "
            "scheduler at work (concurrent streams, tokens/s). Leave --model out (smollm2) or "
            "give a checkpoint folder or .gguf file to see a real model's text."
        )
    else:
        print(f"Model: {args.model}")
    shown = min(args.show, len(prompts))
    print(f"{len(prompts)} requests, sent at once; the first {shown} are streamed below. Prompts:")
    for i, prompt in enumerate(prompts[:shown]):
        print(f"  [req {i}] {prompt!r}")
    print()


async def _demo(args: argparse.Namespace) -> int:
    engine = await _load(args)
    tok = engine.tokenizer
    chat = args.model != "tiny" and getattr(tok, "chat_template", None) is not None
    pool = DEMO_QUESTIONS if chat else DEMO_PROMPTS
    prompts = (pool * (args.requests // len(pool) + 1))[: args.requests]
    counts = [0] * len(prompts)
    texts = [""] * len(prompts)
    first_token_at: list[float | None] = [None] * len(prompts)
    _demo_header(args, prompts)
    async with engine:
        start = time.perf_counter()

        async def one(i: int, prompt: str) -> None:
            asked = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
            async for delta in engine.stream(**asked, sampling=sampling_of(args)):
                if first_token_at[i] is None:
                    first_token_at[i] = time.perf_counter() - start
                counts[i] += len(delta.token_ids)
                texts[i] += delta.text or ""
                if i < args.show:
                    print(f"[req {i}] +{delta.token_ids} {delta.text!r}" + (" <done>" if delta.finished else ""))

        with _lengths_refused():
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - start
    if engine.tokenizer is not None:
        print("\nCompleted text:")
        for i in range(len(prompts)):
            print(f"  [req {i}] {prompts[i]!r} -> {texts[i]!r}")
    total = sum(counts)
    ttfts = sorted(t for t in first_token_at if t is not None)
    ttft = f"median time to first token {1000 * ttfts[len(ttfts) // 2]:.1f} ms" if ttfts else "no tokens"
    print(
        f"\n{len(prompts)} concurrent requests on {args.model} ({args.device}, loop={engine.scheduler.config.loop}): "
        f"{total} tokens in {elapsed:.2f} s = {total / elapsed:.1f} tokens/s; {ttft}"
    )
    return 0


@contextlib.contextmanager
def _lengths_refused() -> Iterator[None]:
    """A ``--max-new-tokens`` the context cannot hold after the prompt is refused, as the
    server refuses such a ``max_tokens``: the engine would serve it shortened
    (:class:`~omni_async.errors.LengthLimitWarning`), which a command must not do silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", errors.LengthLimitWarning)
        try:
            yield
        except errors.LengthLimitWarning as limit:
            raise errors.RequestRejectedError(
                f"--max-new-tokens {limit.asked}: {limit.reason}; lower --max-new-tokens or shorten the prompt"
            ) from None


def _generate_request(args: argparse.Namespace, tokenizer: object) -> dict:
    """What ``generate`` asks: token ids, chat turns (``--messages``, or ``--prompt`` as one
    user turn when the model has a chat template), or ``--raw`` text as it is."""
    if args.input_ids is not None:
        try:
            return {"input_ids": [int(t) for t in args.input_ids.split(",")]}
        except ValueError:
            raise errors.InvalidRequestError("--input-ids must be comma-separated integers") from None
    if args.messages is not None:
        try:
            messages = json.loads(args.messages)
        except ValueError as exc:
            raise errors.InvalidRequestError(f"--messages is not JSON: {exc}") from None
        return {"messages": messages}
    if not args.raw and getattr(tokenizer, "chat_template", None) is not None and args.model != "tiny":
        return {"messages": [{"role": "user", "content": args.prompt}]}
    return {"prompt": args.prompt}


async def _generate(args: argparse.Namespace) -> int:
    _generate_request(args, None)  # bad ids or JSON fail before the model loads
    # One request: a KV cache of GENERATE_KV_TOKENS, not a share of the machine's memory
    # (zeroing that much is a visible part of a short command's start).
    engine = await _load(args, {"kv_capacity_tokens": GENERATE_KV_TOKENS})
    async with engine:
        with _lengths_refused():
            res = await engine.generate(**_generate_request(args, engine.tokenizer), sampling=sampling_of(args))
    if args.details or args.input_ids is not None or res.text is None:
        print(f"output_ids: {res.output_ids}")
        print(f"finish_reason: {res.finish_reason}")
        if res.text is not None:
            print(f"text: {res.text!r}")
    else:
        print(res.text)
    return 0


async def _serve(args: argparse.Namespace) -> int:
    """Listen first (a port in use fails before the model loads), load, serve until
    SIGINT/SIGTERM; one line when ready and one when stopped. A speech checkpoint is served
    by the speech app (POST /v1/audio/speech); a Qwen3-Omni folder that speaks by the text
    app with audio out (its three stages)."""
    with signals_noted() as interrupted:  # until serving, a signal is kept for after the load (which runs in a thread)
        from .server import listening_socket, serve  # preflight checked the serve extra
        from .speech.omni_config import speaks
        from .speech.speak import load_omni
        from .speech.stage import is_speech_checkpoint

        sock = listening_socket(args.host, args.port)
        try:
            if is_speech_checkpoint(args.model):
                from .speech.speak import load_speech, speech_schedule

                served = await load_speech(args, schedule=speech_schedule(args), **engine_limits(args))
                app_kw: dict[str, Any] = {}
            else:
                served = await (load_omni(args, **engine_limits(args)) if speaks(args.model) else _load(args))
                app_kw = {"chat_template": args.chat_template, "tool_call_parser": args.tool_call_parser,
                          "generation_config": args.generation_config}
        except BaseException:
            sock.close()
            raise
    if interrupted.is_set():
        sock.close()
        await served.aclose()
        print("stopped: interrupted while loading", file=sys.stderr, flush=True)
        return 0

    def ready(url: str, model_name: str) -> None:
        print(f"serving {model_name} at {url}/v1 (Ctrl-C to stop)", file=sys.stderr, flush=True)

    aborted = await serve(
        served, sock=sock, log_level=args.log_level, on_ready=ready, model_name=args.served_model_name, api_key=args.api_key, **app_kw,
    )
    print(f"stopped: {aborted} open requests aborted", file=sys.stderr, flush=True)
    return 0


def _add_speak_parser(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    from .speech.names import DEFAULT_SPEECH_MODEL

    p = sub.add_parser("speak", help=f"speak one text into a WAV file (a Qwen3-TTS model; built in: {DEFAULT_SPEECH_MODEL})", formatter_class=fmt)
    add_speak_flags(p)
    add_device_flags(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = CommandParser(prog="omni-async", description=DESCRIPTION, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream several concurrent requests and print tokens/s", formatter_class=fmt)
    _add_model_args(demo)
    _add_sampling_args(demo, 48)
    demo.add_argument("--requests", type=_count(1), default=8, help="requests sent at once")
    demo.add_argument("--show", type=_count(0), default=2, help="print the stream of this many requests")
    gen = sub.add_parser(
        "generate", help=f"answer one prompt (a KV cache of {GENERATE_KV_TOKENS} tokens unless --kv-capacity-tokens)", formatter_class=fmt
    )
    _add_model_args(gen)
    _add_sampling_args(gen, 64)
    # One of the three is required: checked in main() after unknown flags, so that a
    # misspelt --prompt is reported as misspelt, not as --prompt missing.
    group = gen.add_mutually_exclusive_group()
    group.add_argument("--prompt", help="a question or instruction: sent as one user turn through the model's chat template (see --raw)")
    group.add_argument("--messages", help='chat turns as JSON, e.g. \'[{"role": "user", "content": "Hi"}]\'')
    group.add_argument("--input-ids", help="comma-separated token ids")
    gen.add_argument("--raw", action="store_true", help="send --prompt as plain text, without the chat template")
    gen.add_argument("--details", action="store_true", help="print output_ids, finish_reason and the text's repr instead of the text")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (extra [serve])", formatter_class=fmt)
    _add_model_args(serve)
    serve.add_argument("--host", default=env_default("host", "127.0.0.1"), help="address to listen on [env OMNI_ASYNC_HOST]")
    serve.add_argument("--port", type=port_number, default=env_default("port", 8000, port_number), help="port to listen on, 1-65535 [env OMNI_ASYNC_PORT]")
    serve.add_argument(
        "--served-model-name", default=env_default("served_model_name", None),
        help="the model id clients send; None: what --model names (tiny, smollm2, or a folder's or file's last path component) [env OMNI_ASYNC_SERVED_MODEL_NAME]",
    )
    serve.add_argument("--api-key", default=env_default("api_key", None), help="clients must send it as 'Authorization: Bearer KEY' (401 otherwise; /health, /metrics and /version stay open) [env OMNI_ASYNC_API_KEY]")
    serve.add_argument("--chat-template", default=env_default("chat_template", None), help="a Jinja chat template (a file, or the template itself) in place of the checkpoint's [env OMNI_ASYNC_CHAT_TEMPLATE]")
    serve.add_argument("--tool-call-parser", default=env_default("tool_call_parser", "auto"), choices=("auto", "hermes", "llama3_json", "mistral"), help="the format tool calls are parsed in; auto: from the chat template [env OMNI_ASYNC_TOOL_CALL_PARSER]")
    serve.add_argument("--generation-config", default=env_default("generation_config", "auto"), choices=("auto", "none"), help="auto: sampling defaults from the checkpoint's generation_config.json where a request leaves them unset [env OMNI_ASYNC_GENERATION_CONFIG]")
    add_schedule_flags(serve)  # the --speech-* flags
    # The server owns its process, so the collector is tuned for serving unless told
    # otherwise (a full GC pass over torch's heap stalls every stream; bench/RESULTS.md).
    serve.set_defaults(
        gc_freeze=env_default("gc_freeze", True, parse_bool),
        gc_gen0_threshold=env_default("gc_gen0_threshold", 10_000, int),
    )
    pipe = sub.add_parser("pipeline-demo", help="a thinker streaming into a talker in one event loop on one device", formatter_class=fmt)
    add_device_flags(pipe)
    # Not offered: refused in main() with a pointer to --thinker and --talker.
    pipe.add_argument("--model", default=None, help=argparse.SUPPRESS)
    pipe.add_argument("--thinker", default="tiny", help="the thinker: a checkpoint folder, a .gguf file, 'smollm2', or 'tiny' (built in)")
    pipe.add_argument("--talker", default="tiny", help="the talker: a checkpoint folder, a .gguf file, 'smollm2', or 'tiny' (built in, another seed)")
    for stage in ("thinker", "talker"):
        pipe.add_argument(
            f"--{stage}-share", type=_share, default=None,
            help=f"the {stage}'s memory budget: a fraction of the device's total memory (0.3) or bytes (an integer)",
        )
    speak = _add_speak_parser(sub, fmt)
    for command in (demo, gen, serve, pipe, speak):  # an unknown flag is reported with its command's usage
        command.set_defaults(command_parser=command)
    from .serving.ray_command import add_parser as add_serve_ray  # no Ray import until it runs

    add_serve_ray(sub, fmt)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.refuse_unknown(unknown)
    if args.command == "generate" and args.prompt is None and args.messages is None and args.input_ids is None:
        args.command_parser.error("one of --prompt, --messages or --input-ids is required")
    if args.command == "pipeline-demo" and args.model is not None:
        args.command_parser.error("pipeline-demo takes its checkpoints from --thinker and --talker, not --model")
    configure_cli_logging(args.log_level)
    debug = args.log_level == "DEBUG"
    try:
        preflight(args)
        return _run(args)
    except KeyboardInterrupt:
        # serve: uvicorn shut down cleanly, then passed Ctrl-C on
        return 0 if args.command == "serve" else 130
    except Exception as exc:  # typed errors, and faults of ours: one line (the traceback at DEBUG)
        status = report(exc, traceback=debug)
        if not isinstance(exc, errors.OmniAsyncError) and not debug:
            print("(run with --log-level DEBUG for the traceback)", file=sys.stderr)
        return status


def _run(args: argparse.Namespace) -> int:
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    if args.command == "demo":
        return runner(_demo(args))
    if args.command == "generate":
        return runner(_generate(args))
    if args.command == "serve":
        try:
            return runner(_serve(args))
        except KeyboardInterrupt:  # uvicorn shut down cleanly, then passed Ctrl-C on
            return 0
    if args.command == "speak":
        from .speech.speak import speak

        return runner(speak(args))
    if args.command == "serve-ray":
        from .serving.ray_command import run_command

        return run_command(args)
    from .pipeline import run_pipeline_demo

    return runner(run_pipeline_demo(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
