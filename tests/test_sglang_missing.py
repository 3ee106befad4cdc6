"""Without SGLang installed, backend="sglang" fails with a clear error naming the extra."""

from __future__ import annotations

import importlib.util

import pytest

from omni_async import Engine, errors

@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None, reason="sglang is installed here (tests/sglang covers it)"
)
def test_sglang_backend_without_sglang_names_the_extra(tmp_path):
    from omni_async.backends.sglang import SGLangUnavailableError

    with pytest.raises(SGLangUnavailableError) as info:
        Engine.from_pretrained(str(tmp_path), backend="sglang")
    err = info.value
    assert isinstance(err, errors.OmniAsyncError) and isinstance(err, ImportError)
    assert "pip install -e '.[sglang]'" in str(err)
    assert "scripts/install_sglang.sh" in str(err)
    assert "0.5.23" in str(err)


def test_backends_package_imports_nothing_heavy():
    import subprocess
    import sys

    code = (
        "import sys, omni_async.backends, omni_async.backends.sglang; "
        "print(int(any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_unknown_backend_is_refused():
    with pytest.raises(errors.ConfigError, match="unknown backend"):
        Engine.from_pretrained("tiny", backend="vllm")
