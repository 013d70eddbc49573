"""Data: the batch and the column stores it is cut from (:mod:`.batch`), the datasets, samplers
and resumable loader (:mod:`.loading`), the synthetic generator and its cache (:mod:`.synthetic`),
Criteo's files (:mod:`.criteo`), the sequence data (:mod:`.sequence`) and the data modules
(:mod:`.modules`)."""

from lightning_sparselift.data.batch import RecBatch
from lightning_sparselift.data.loading import EvenDistributedSampler
from lightning_sparselift.data.modules import CriteoDataModule, RecDataModule
from lightning_sparselift.data.sequence import SequenceDataModule

__all__ = ["CriteoDataModule", "EvenDistributedSampler", "RecBatch", "RecDataModule", "SequenceDataModule"]
