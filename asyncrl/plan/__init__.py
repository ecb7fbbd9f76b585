"""`asyncrl plan`: a discrete-event simulator of the pipeline, its calibration from a run dir, and
its projection for fleets this machine does not have. Imports neither torch, vllm nor ray."""

from .inputs import Lengths, PlanInputs, load_plan_inputs
from .simulate import PlanResult, StepTrace, simulate

__all__ = ["Lengths", "PlanInputs", "PlanResult", "StepTrace", "load_plan_inputs", "simulate"]
