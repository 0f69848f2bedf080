"""SGLang's NGRAM speculative decoding (``--speculative-algorithm NGRAM``) on our runner.

SGLang drafts from its n-gram corpus (its own ``NgramCorpus``: every ``--speculative-ngram-*`` flag
keeps its meaning) and our runner verifies, as it does for our engine's and vLLM's n-gram drafts:

  SGLang (host)                                   our runner (JAX)
  corpus tree per request: tokens [n], mask [n, n]   the tree's first path from its root, a chain:
  root = the request's last sampled token            ScheduledSeq(token_ids=[root],
  slots seq_len..seq_len+n-1 (allocated ahead)         draft_token_ids=chain[1:], pages to the end)
  accept_tokens [bs, n], accept_lens [bs]        <-  accepted drafts + the token after them

The chain is written where SGLang's verify window puts it (positions seq_len.. of the request's own
slots), so accepted tokens' K/V are already where SGLang expects them and nothing is moved; rejected
ones lie past the new sequence length and are overwritten later. Only a chain is verified: the
platform sets ``--speculative-ngram-max-bfs-breadth 1`` (platform.py), so the corpus builds one.
Greedy requests get exactly the tokens they would get without speculation; sampled ones go through
our runner's rejection sampler.
"""

from __future__ import annotations

import numpy as np
import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from tpuserve.tpu_platform.sglang_plugin.tree import first_path


class TpuServeNgramWorker(BaseSpecWorker):
    """The worker SGLang's scheduler drives for ``--speculative-algorithm NGRAM`` on this platform.

    SGLang's own NGRAM worker cannot be used: its module loads CUDA kernels (sgl_kernel) on import.
    This one keeps what the scheduler relies on: the corpus (SGLang's ``NgramCorpus``, built from
    the same flags), the external-corpus calls of SGLang's corpus manager, and the V2 result schema
    (``accept_lens``, rows of ``speculative_num_draft_tokens`` tokens, ``new_seq_lens``,
    ``next_draft_input``). Runs synchronously: the platform turns the overlap scheduler off."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        spec = get_spec()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None  # drafts come from the host-side corpus, not a model
        self.model_runner = target_worker.model_runner
        self.draft_token_num = int(spec.speculative_num_draft_tokens)
        self.speculative_num_draft_tokens = self.draft_token_num
        self.max_trie_depth = int(spec.speculative_ngram_max_trie_depth)
        self._prev_decode_rids: set = set()
        self.ngram_corpus = NgramCorpus(
            min_bfs_breadth=spec.speculative_ngram_min_bfs_breadth,
            max_bfs_breadth=spec.speculative_ngram_max_bfs_breadth,
            match_type=spec.speculative_ngram_match_type,
            capacity=spec.speculative_ngram_capacity,
            max_trie_depth=spec.speculative_ngram_max_trie_depth,
            draft_token_num=self.draft_token_num,
            external_sam_budget=spec.speculative_ngram_external_sam_budget,
            external_corpus_max_tokens=spec.speculative_ngram_external_corpus_max_tokens,
        )
        path = spec.speculative_ngram_external_corpus_path
        if path is not None:
            # on use: only a server given an external corpus reads one
            from sglang.srt.speculative.cpp_ngram.external_corpus import iter_external_corpus_chunks

            chunks = list(
                iter_external_corpus_chunks(
                    path, target_worker.tokenizer, spec.speculative_ngram_external_corpus_max_tokens
                )
            )
            self.commit_corpus_load(path, self.add_external_corpus(path, chunks))

    # ---- what SGLang's scheduler and corpus manager call besides the forward ----

    def clear_cache_pool(self):
        self.ngram_corpus.reset()
        self._prev_decode_rids = set()

    def add_external_corpus(self, corpus_id: str, token_chunks: list[list[int]]) -> int:
        return self.ngram_corpus.load_external_corpus_named(corpus_id, token_chunks)

    def commit_corpus_load(self, corpus_id: str, loaded_token_count: int) -> None:
        self.ngram_corpus.commit_external_corpus_load(corpus_id, loaded_token_count)

    def remove_external_corpus(self, corpus_id: str) -> None:
        self.ngram_corpus.remove_external_corpus(corpus_id)

    def list_external_corpora(self) -> dict[str, int]:
        return self.ngram_corpus.list_external_corpora()

    # ---- one scheduled batch ----

    def _contexts(self, batch) -> list[list[int]]:
        """Each request's last ``max_trie_depth`` tokens (prompt, then output): what the corpus
        matches and learns from. Multimodal padding ids are not tokens: the unpadded prompt."""
        depth = self.max_trie_depth
        out = []
        for req in batch.reqs:
            tail = list(req.output_ids[-depth:])
            if len(tail) < depth:
                tail = list(req.origin_input_ids_unpadded[-(depth - len(tail)) :]) + tail
            out.append(tail)
        return out

    def forward_batch_generation(
        self, batch, on_publish=None, pp_proxy_tensors=None
    ) -> GenerationBatchResult:
        n = self.draft_token_num
        bs = len(batch.reqs)
        if not batch.forward_mode.is_decode():  # prefill chunks and idle batches: no drafts
            result = self._target_worker.forward_batch_generation(batch)
            accept_tokens = torch.zeros((bs, n), dtype=torch.int64)
            accept_tokens[:, 0] = result.next_token_ids
            return self._result(
                next_token_ids=result.next_token_ids,
                accept_tokens=accept_tokens,
                accept_lens=torch.ones(bs, dtype=torch.int32),
                new_seq_lens=batch.seq_lens,
                on_publish=on_publish,
            )

        contexts = self._contexts(batch)
        self.ngram_corpus.synchronize()  # inserts run in the corpus's own thread
        drafts, mask = self.ngram_corpus.batch_get(
            [req.rid for req in batch.reqs],
            contexts,
            [len(req.origin_input_ids_unpadded) + len(req.output_ids) for req in batch.reqs],
        )
        drafts = np.asarray(drafts).reshape(bs, n)
        mask = np.asarray(mask, dtype=bool).reshape(bs, n, n)
        chains = [drafts[i, first_path(mask[i])].tolist() for i in range(bs)]
        tokens, num_accepted = self._target_worker.verify_chains(batch, chains)
        accept_lens = torch.from_numpy(num_accepted.astype(np.int32) + 1)
        accept_tokens = torch.zeros((bs, n), dtype=torch.int64)
        accept_tokens[:, : tokens.shape[1]] = torch.from_numpy(np.maximum(tokens, 0).astype(np.int64))
        new_seq_lens = batch.seq_lens + accept_lens.to(batch.seq_lens.dtype)

        # The corpus learns each request's context as it stood before this step, as SGLang's worker
        # does (this step's tokens join it on the next one).
        self.ngram_corpus.batch_put(contexts)
        current = {req.rid for req in batch.reqs}
        departed = self._prev_decode_rids - current  # requests gone from the decode batch
        if departed:
            self.ngram_corpus.erase_match_state(list(departed))
        self._prev_decode_rids = current
        return self._result(
            next_token_ids=accept_tokens.flatten(),
            accept_tokens=accept_tokens,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            on_publish=on_publish,
        )

    def _result(
        self, *, next_token_ids, accept_tokens, accept_lens, new_seq_lens, on_publish
    ) -> GenerationBatchResult:
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None),
            next_token_ids=next_token_ids,
            can_run_cuda_graph=False,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=NgramVerifyInput(
                draft_token_num=self.draft_token_num,
                new_seq_lens=new_seq_lens,
                accept_tokens=accept_tokens.flatten(),
                accept_lens=accept_lens,
            ),
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
        )
