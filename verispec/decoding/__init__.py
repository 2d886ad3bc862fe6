"""Layer 5: the decoding loops: one sequence (engine), many (batch), the statistics they keep, and the k
policies that choose each round's draft length."""
