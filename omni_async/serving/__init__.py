"""Serving beyond one process: omni-async replicas on Ray Serve (:mod:`.ray_serve`, extra
``[ray]``). Replicas behind SGLang's router need nothing from here: ``omni-async serve``
already answers the endpoints the router reads (see docs/scaling.md). :mod:`.listen` makes
the listening socket both commands check before anything loads; :mod:`.signals` keeps a
Ctrl-C that comes while ``serve`` loads."""
