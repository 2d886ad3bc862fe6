from verispec.core.draft import Draft
from verispec.proposers.base import Proposer
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.hybrid import HybridProposer
from verispec.proposers.ngram import NgramProposer
from verispec.proposers.suffix import SuffixProposer

__all__ = ["Draft", "Proposer", "DraftModelProposer", "HybridProposer", "NgramProposer", "SuffixProposer"]
