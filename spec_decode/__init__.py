"""Speculative decoding: draft proposers and the lossless verification of their drafts.

Modules:
  ngram              n-gram (prompt lookup) drafting on the host, vLLM's ``method="ngram"`` rule
                     (``NgramProposer``, ``propose_ngram``)
  rejection_sampler  device verification of a step's drafts: greedy matching, and rejection sampling
                     with one-hot or given draft distributions (``verify_async``, called by
                     ``ModelRunner.sample``)
EAGLE-3 and MTP draft heads are still to come.
"""
