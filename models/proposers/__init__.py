"""Draft proposers for speculative decoding, behind one interface (base.Proposer)."""

from models.proposers.base import Proposer, SpecRequest
from models.proposers.draft import DraftModelProposer, check_same_vocabulary
from models.proposers.ngram import NgramProposer

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "SpecRequest", "check_same_vocabulary"]
