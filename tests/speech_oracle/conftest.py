"""Fixtures for the tests against the Qwen3-TTS reference implementation (``qwen-tts``).

The reference pins its own transformers, so it lives in an isolated environment that
``scripts/install_ttsref.sh`` builds, together with a tiny random-weight checkpoint made by
the reference's own classes and the reference's outputs on it. These tests read only those
files (never the reference's code), and run only when ``OMNI_TTS_ORACLE`` names that folder:

    bash scripts/install_ttsref.sh
    OMNI_TTS_ORACLE=$PWD/.ttsref .venv/bin/python -m pytest -q -p no:cacheprovider tests/speech_oracle

Without it every test here is skipped; with it, a folder that is incomplete is an error, not
a skip, so a broken install cannot pass as a green run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ORACLE_ENV = "OMNI_TTS_ORACLE"
MODEL_SUBDIR = "tiny-tts"        # the checkpoint (model folder with speech_tokenizer/)
REFERENCE_SUBDIR = "tiny-ref"    # reference_outputs.npz / reference_outputs.json
SPEAKERS = ("ryan", "vivian")
TEXTS = 3
MAIN_CASES = tuple(f"main/{spk}_t{i}" for spk in SPEAKERS for i in range(TEXTS))


@pytest.fixture(scope="session", autouse=True)
def oracle_dir() -> Path:
    """The built reference folder; every test here is skipped without one."""
    value = os.environ.get(ORACLE_ENV)
    if not value:
        pytest.skip(f"{ORACLE_ENV} is not set (bash scripts/install_ttsref.sh builds the oracle)")
    root = Path(value)
    needed = [root / MODEL_SUBDIR / "config.json", root / MODEL_SUBDIR / "speech_tokenizer" / "model.safetensors",
              root / REFERENCE_SUBDIR / "reference_outputs.npz", root / REFERENCE_SUBDIR / "reference_outputs.json"]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        pytest.fail(f"{ORACLE_ENV}={root} is incomplete (rerun scripts/install_ttsref.sh): missing {missing}")
    return root


@pytest.fixture(scope="session")
def tts_model_dir(oracle_dir: Path) -> Path:
    """The tiny checkpoint folder, in the layout the reference loads."""
    return oracle_dir / MODEL_SUBDIR


@pytest.fixture(scope="session")
def reference_arrays(oracle_dir: Path) -> dict[str, np.ndarray]:
    """Every array the reference wrote (``main/{spk}_t{i}/codes``, ``.../wav``, ``decode330/...``)."""
    with np.load(oracle_dir / REFERENCE_SUBDIR / "reference_outputs.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="session")
def reference_summary(oracle_dir: Path) -> dict[str, Any]:
    """The reference run's metadata: versions, ids, per-case codes, EOS and timings."""
    return json.loads((oracle_dir / REFERENCE_SUBDIR / "reference_outputs.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def reference_cases(reference_summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The JSON's cases by name (``main/ryan_t0``, ``extra/batched6``, ...)."""
    return {case["name"]: case for case in reference_summary["cases"]}
