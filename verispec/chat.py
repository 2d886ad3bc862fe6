"""`verispec.chat.ChatBot`, the multi-turn chat API, kept at this public path; it lives in verispec.apps.chat."""

from verispec.apps.chat import ChatBot, TurnStats

__all__ = ["ChatBot", "TurnStats"]
