"""lm-evaluation-harness's model interface over our offline ``LLM``: the same task, tokenized by
lm-eval itself (``TemplateLM`` splits context and continuation), scored from our prompt logprobs and
greedy generations. Tokenization mirrors lm-eval's ``local-completions`` client with a Hugging Face
tokenizer (no special tokens added), so the two must agree exactly."""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from transformers import AutoTokenizer

from tpuserve import LLM, SamplingParams


class OfflineLM(TemplateLM):
    def __init__(self, llm: LLM, tokenizer_dir: str):
        super().__init__()
        self.llm = llm
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens)).input_ids

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        prompts = [{"prompt_token_ids": ctx + cont} for _, ctx, cont in requests]
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for (_, ctx, cont), out in zip(requests, outs):
            assert out.error is None, out.error
            total, greedy = 0.0, True
            # Position p scores token p given tokens < p: the continuation's are len(ctx)...
            for p in range(len(ctx), len(ctx) + len(cont)):
                entry = out.prompt_logprobs[p]
                chosen = entry[out.prompt_token_ids[p]].logprob
                total += chosen
                greedy = greedy and chosen >= max(lp.logprob for lp in entry.values())
            results.append((total, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("the tiny task scores no rolling loglikelihoods")

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for context, gen_kwargs in (r.args for r in requests):
            kw = dict(gen_kwargs)
            until = kw.pop("until", [])
            # What local-completions asks the server for: the task's stops plus the EOS text.
            stop = list(until) + [e for e in [self.tokenizer.eos_token] if e not in until]
            params.append(SamplingParams(temperature=0, max_tokens=kw.pop("max_gen_toks", 256), stop=stop))
            prompts.append({"prompt_token_ids": self.tok_encode(context)})
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        for out in outs:
            assert out.error is None, out.error
        return [out.outputs[0].text for out in outs]
