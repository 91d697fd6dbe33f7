"""Proposers: what guesses the next D tokens (n-gram lookup, draft model, MTP head, EAGLE tree).

Every proposer hands the verifier the same thing: draft tokens [B, D] with per-row counts
[B] and, for sampled drafts, the distributions they came from.
"""
from specsched.runtime.proposers.ngram import NgramProposer

__all__ = ["NgramProposer"]
