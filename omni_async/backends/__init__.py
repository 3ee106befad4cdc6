"""Optional backends behind the same AsyncOmniScheduler and Engine API.

Each backend lives in a subpackage of its own and imports its heavy dependencies only
when it is used: importing this package imports nothing beyond the standard library.

- ``omni_async.backends.sglang``: composes SGLang's scheduler machinery and its
  tensor-parallel model worker in-process (``pip install -e '.[sglang]'`` in the checkout, or
  ``scripts/install_sglang.sh`` on a CPU-only machine).
"""
