"""Speculative decoding: which drafts a request gets, above the runner and Worker, below the engine.

Modules:
  ngram              n-gram (prompt lookup) drafting on the host, vLLM's ``method="ngram"`` rule
                     (``NgramProposer``, ``propose_ngram``)
  coordinator        a request's drafts from proposal to verification and catch-up
                     (``SpecDecodeCoordinator``), and the one rule for whether a request may draft
                     (``may_draft``), shared by the engine and the vLLM plugin

The device side sits lower, with what it runs beside: the rejection sampler that verifies a step's
drafts next to the sampler (``tpu_platform/rejection_sampler.py``), the EAGLE-3 / MTP draft heads
with the models and their loaders (``tpu_platform/models/draft_head.py``,
``tpu_platform/loader/draft_head.py``), and their paged runner next to the ModelRunner
(``tpu_platform/draft_runner.py``), which the Worker builds.
"""
