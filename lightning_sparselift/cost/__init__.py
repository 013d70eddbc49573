"""Cost: the step-time model that predicts every candidate (:mod:`.step_model`, from the machine's
constants of :mod:`.priors`), the clocks and protocols that measure them (:mod:`.calibration`), the
designs that measure several at once (:mod:`.design`) and the rule that decides them
(:mod:`.decision`)."""

from lightning_sparselift.cost.calibration import CalibrationProtocol, Measurement, RegionClock
from lightning_sparselift.cost.design import FactorialDesign
from lightning_sparselift.cost.priors import AlphaBeta, LookupModel, Priors, measure_priors
from lightning_sparselift.cost.step_model import StepModel
from lightning_sparselift.cost.step_record import StepPrediction

__all__ = ["AlphaBeta", "CalibrationProtocol", "FactorialDesign", "LookupModel", "Measurement", "Priors", "RegionClock",
           "StepModel", "StepPrediction", "measure_priors"]
