"""Layer 2: the math of one round, pure functions over tensors: sampling, the rejection sampler, token trees
and their verification, the rows that feed verification, the committed sequence, stage timing."""
