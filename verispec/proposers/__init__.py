from verispec.core.draft import Draft
from verispec.proposers.base import Drafter, Lookup
from verispec.proposers.draft_model import DraftModel
from verispec.proposers.hybrid import HybridDrafter
from verispec.proposers.lookup import LookupDrafter
from verispec.proposers.ngram import NgramProposer
from verispec.proposers.suffix import SuffixHistory, SuffixProposer

__all__ = ["Draft", "Drafter", "DraftModel", "HybridDrafter", "Lookup", "LookupDrafter", "NgramProposer",
           "SuffixHistory", "SuffixProposer"]
