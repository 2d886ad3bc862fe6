"""How many tokens to draft: the policy interface and fixed k (base), cost-aware k, token-tree budgets."""
