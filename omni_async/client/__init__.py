"""The caller's side of an engine: request handles, their output collectors and
completions, the per-step router from the stage's messages to the handles, reader
wake-ups, and the bridge for calls from another event loop."""
