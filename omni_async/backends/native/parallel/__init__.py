"""Tensor parallelism for the native backend: one engine across several devices.

The asyncio stage runs in the caller's process as rank 0; ranks 1..N-1 are worker
processes (:mod:`.worker`) that receive each step's forward inputs and run the same
forward on their shard of the model. Modules by concern: :mod:`.sharding` (which slice
of each Hugging Face tensor a rank holds, and the layers that communicate),
:mod:`.comm` (the group's collectives and control messages), :mod:`.plan` (a step's
forward inputs packed into one broadcast), :mod:`.worker` (the worker loop),
:mod:`.runner` (rank 0's runner and weight updates) and :mod:`.launch` (starting and
stopping the group).
"""
