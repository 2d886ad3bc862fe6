"""An OpenAI-compatible HTTP server on the speculative engine."""
