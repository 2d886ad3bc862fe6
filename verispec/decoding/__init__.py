"""Layer 5: the decoding loop: the engine's round over every sequence at once (one, or a batch), the prompts it
feeds and shares, the statistics it keeps, and the k policies that choose each round's draft length."""
