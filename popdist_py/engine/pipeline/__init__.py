"""Pipelining: a replica's model split into stages on several devices (PopART's pipelining).

:class:`Stage` is one part of the model (forward, backward, device); :class:`Pipeline` runs the
stages of each replica on its devices in a 1F1B or GPipe schedule and is what a
:class:`~popdist_py.engine.Trainer` trains; :mod:`.trace` writes a step's timeline.
"""

from popdist_py.engine._public import publish as _publish
from popdist_py.engine.pipeline.pipeline import Pipeline, PipelineStageError
from popdist_py.engine.pipeline.schedule import GPIPE, ONE_F_ONE_B, SCHEDULES, ideal_bubble
from popdist_py.engine.pipeline.stages import Stage
from popdist_py.engine.pipeline.trace import bubble, chrome_trace

__all__ = ["GPIPE", "ONE_F_ONE_B", "SCHEDULES", "Pipeline", "PipelineStageError", "Stage", "bubble", "chrome_trace",
           "ideal_bubble"]
_publish(globals())
