"""The JAX side of the plugin alone (no SGLang): SGLang-style scattered pages and split steps.

Runs in any venv with our runtime. The executor is driven the way the SGLang worker drives it: page
tables are whatever page ids an allocator handed out, prompts are cut into steps smaller than the
prompt, decode steps feed back the sampled id. Greedy tokens must equal our standalone engine's.
"""

from __future__ import annotations

import pytest

from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

pytestmark = pytest.mark.timeout(600)

PAGE = 16


@pytest.fixture(scope="module")
def executor(hf_dir):
    from tpuserve.tpu_platform.sglang_plugin.executor import ExecutorConfig, JaxExecutor

    # 16-token steps: every prompt below spans several steps, as a long SGLang chunk would.
    return JaxExecutor(
        ExecutorConfig(
            model_path=hf_dir,
            page_size=PAGE,
            max_model_len=8192,
            dtype="float32",
            max_total_tokens=1024,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            layer_loop="scan",
        )
    )


def _greedy(executor, prompts: list[list[int]], pages: list[list[int]], steps: int):
    """Prefill every prompt in one call (split inside the executor), then decode in lockstep."""
    outs = [[] for _ in prompts]
    work = [
        ScheduledSeq(token_ids=p, num_computed=0, page_ids=pg[: -(-len(p) // PAGE)], sampling=SamplingRow())
        for p, pg in zip(prompts, pages)
    ]
    for _ in range(steps):
        sampled = executor.run(work)
        for o, tok in zip(outs, sampled):
            o.append(int(tok))
        work = []
        for p, pg, o in zip(prompts, pages, outs):
            total = len(p) + len(o)
            work.append(
                ScheduledSeq(
                    token_ids=[o[-1]],
                    num_computed=total - 1,
                    page_ids=pg[: -(-total // PAGE)],
                    sampling=SamplingRow(),
                )
            )
    return outs


def test_scattered_pages_and_split_steps_match_standalone(executor, reference_llm):
    from tpuserve.server.sampling_params import SamplingParams

    tok = reference_llm.get_tokenizer()
    texts = ["The capital of France is", "Here is a list of fruits: apples, pears, plums, " * 3]
    prompts = [tok.encode(t) for t in texts]
    assert len(prompts[1]) > 2 * 16  # spans several 16-token steps
    pages = [[37, 5, 61, 2, 19], [8, 44, 3, 50, 12, 27]]  # as an allocator might hand them out
    got = _greedy(executor, prompts, pages, steps=10)
    ref = reference_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert got == [list(r.outputs[0].token_ids) for r in ref]
    assert executor.model_calls > 10  # prefill really was split


def test_capacity_follows_max_total_tokens(executor):
    assert executor.capacity_tokens == 1024
    assert executor.num_pages == 1024 // PAGE + 1  # + page 0, reserved on both sides
    assert executor.runner.kv_cache.shape[1] == executor.num_pages


def test_verify_accepts_exactly_the_greedy_prefix_of_each_chain(executor):
    """SGLang's NGRAM path (spec_ngram.py) hands the executor chains: the last token, then drafts.
    The oracle is the executor's own plain greedy decode of the same prompt (no drafts)."""
    prompt = list(range(300, 340))
    pages = [[9, 33, 21, 14]]
    greedy = _greedy(executor, [prompt], pages, steps=6)[0]
    # The prompt's K/V is in place (the greedy run wrote it); from the first sampled token on,
    # verify chains whose drafts agree with greedy for 0, 2 and all 4 tokens, then diverge.
    root, cont = greedy[0], greedy[1:5]
    chains = {
        0: [root, (cont[0] + 1) % 1000, cont[1]],
        2: [root, cont[0], cont[1], (cont[2] + 7) % 1000],
        4: [root, *cont],
    }
    for agree, chain in chains.items():
        total = len(prompt) + len(chain)
        seq = ScheduledSeq(
            token_ids=[chain[0]],
            num_computed=len(prompt),
            page_ids=pages[0][: -(-total // PAGE)],
            sampling=SamplingRow(),
            draft_token_ids=chain[1:],
        )
        tokens, accepted = executor.verify([seq])
        assert int(accepted[0]) == agree, (agree, tokens)
        # The accepted drafts, then the token greedy decoding puts after them.
        assert tokens[0, : agree + 1].tolist() == greedy[1 : agree + 2]
