"""The benchmark harness: plain vs speculative decoding, interleaved in one process."""
