from verispec.proposers.base import Draft, Proposer
from verispec.proposers.draft_model import DraftModelProposer

__all__ = ["Draft", "Proposer", "DraftModelProposer"]
