"""Speculative decoding: draft proposers and the lossless verification of their drafts.

Modules:
  ngram              n-gram (prompt lookup) drafting on the host, vLLM's ``method="ngram"`` rule
                     (``NgramProposer``, ``propose_ngram``)
  rejection_sampler  device verification of a step's drafts: greedy matching, and rejection sampling
                     with one-hot or given draft distributions (``verify_async``, called by
                     ``ModelRunner.sample``)
  draft_model        EAGLE-3 and MTP draft heads in JAX, and their checkpoint layouts (``load_draft``)
  draft_runner       a draft head's paged KV and its catch-up / drafting programs (``DraftRunner``),
                     driven by the engine around each target step
  coordinator        a request's drafts from proposal to verification and catch-up
                     (``SpecDecodeCoordinator``), and the one rule for whether a request may draft
                     (``may_draft``), shared by the engine and the vLLM plugin
"""
