"""Layer 6: text in, text out: a Pipeline over the engine (chat templates, incremental detokenisation, stop
strings, provenance of streamed tokens)."""
