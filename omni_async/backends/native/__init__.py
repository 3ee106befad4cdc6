"""The native backend: our decoder, KV cache and runner assembled into a stage
(``builder``), checkpoint weights at run time (``weights``) and tensor parallelism
(``parallel``)."""
