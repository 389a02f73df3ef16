"""Sampling: turning (constrained) logits into tokens, and verifying speculative drafts."""
