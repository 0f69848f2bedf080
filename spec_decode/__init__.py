"""Speculative decoding: proposers (n-gram, EAGLE-3, MTP) and the lossless rejection sampler (coming)."""
