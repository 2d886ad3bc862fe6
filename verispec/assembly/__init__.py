"""Layer 7: from specs to a ready Pipeline: which backend, dtype and drafter, loading and sharing models."""
