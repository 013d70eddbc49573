"""Cost: analytical priors that order candidates (:mod:`.priors`) and the measured increments
that decide them (:mod:`.calibration`)."""

from lightning_sparselift.cost.calibration import CalibrationProtocol, Calibrator, Measurement, RegionClock
from lightning_sparselift.cost.priors import AlphaBeta, LookupModel, Priors, measure_priors

__all__ = ["AlphaBeta", "CalibrationProtocol", "Calibrator", "LookupModel", "Measurement", "Priors", "RegionClock", "measure_priors"]
