"""What the command line checks before it loads a model or builds a kernel, and how it
reports a failure.

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
import importlib.util
import sys
from pathlib import Path
from typing import Any

from . import errors
from .cli_options import engine_limits
from .config import SamplingParams, SchedulerConfig

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
            f"omni-async serve needs the serve extra ({', '.join(missing)} not installed): pip install 'omni-async[serve]'"
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


def preflight(args: argparse.Namespace) -> None:
    """Everything the arguments alone decide, checked before anything loads."""
    check_device(args.device)
    if args.command == "pipeline-demo":
        check_model(args.thinker, "--thinker")
        check_model(args.talker, "--talker")
        return
    if args.command == "serve":
        check_serve_extra()
    if hasattr(args, "max_new_tokens"):
        sampling_of(args)
    SchedulerConfig(loop=args.loop, **engine_limits(args))
    check_backend(args.backend, args.model)
    check_model(args.model)

