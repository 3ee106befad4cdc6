"""Stages chained in one event loop: ``TwoStagePipeline`` routes a thinker's stream into
a talker (``two_stage``), ``colocate`` builds stages that share one device with their
memory shares, and ``demo`` is ``omni-async pipeline-demo``."""

from .demo import TALKER_MIN_CHUNKS, make_talker, run_pipeline_demo
from .two_stage import PipelineHandle, StageEvent, TwoStagePipeline, delta_to_chunk

__all__ = ["TwoStagePipeline", "PipelineHandle", "StageEvent", "delta_to_chunk", "make_talker", "run_pipeline_demo", "TALKER_MIN_CHUNKS"]
