"""Layer 8, the front ends: the `verispec` command, the chat REPL and ChatBot, the OpenAI-compatible server,
the benchmark harness, export to other engines."""
