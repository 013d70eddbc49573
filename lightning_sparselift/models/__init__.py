"""Models: what every model family shares as a LightningModule (:mod:`.base`), the DLRM family
(:mod:`.dlrm`) and the sequence-aware ranker (:mod:`.sequence`)."""

from lightning_sparselift.models.base import RecModule
from lightning_sparselift.models.dlrm import DLRMModule
from lightning_sparselift.models.sequence import SequenceRankingModule

__all__ = ["DLRMModule", "RecModule", "SequenceRankingModule"]
