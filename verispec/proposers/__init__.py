from verispec.proposers.base import Draft, Proposer
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.hybrid import HybridProposer
from verispec.proposers.ngram import NgramProposer

__all__ = ["Draft", "Proposer", "DraftModelProposer", "HybridProposer", "NgramProposer"]
