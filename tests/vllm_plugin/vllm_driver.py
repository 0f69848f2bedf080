"""Run ``vllm.LLM`` jobs described by a JSON spec and write the results as JSON (a test helper).

    python vllm_driver.py SPEC.json OUT.json

The tests run this in a child process of the vLLM venv's python: vLLM resolves its platform once
per process (with or without our plugin, as the child's environment says) and spawns its engine core,
so the ``__main__`` guard below is required. Spec:

    {"engine": {LLM kwargs}, "jobs": [
        {"kind": "generate", "prompts": [str | {"prompt_token_ids": [...]}, ...], "params": {...}},
        (params are SamplingParams kwargs; "structured_outputs" a dict of StructuredOutputsParams)
        {"kind": "chat", "messages": [...], "params": {...}},
        {"kind": "metrics"}]}

Each generate/chat job yields one record per prompt: text, token_ids, prompt_token_ids,
num_cached_tokens, finish_reason, logprobs ([{token_id: logprob}] per position), prompt_logprobs.
"metrics" snapshots vLLM's counters (prefix cache queries/hits, preemptions).
"""

from __future__ import annotations

import json
import sys
import time

COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")


def _lp(entries):
    if entries is None:
        return None
    return [None if pos is None else {str(t): float(lp.logprob) for t, lp in pos.items()} for pos in entries]


def _records(outs):
    recs = []
    for o in outs:
        c = o.outputs[0]
        recs.append(
            dict(
                text=c.text,
                token_ids=list(c.token_ids),
                prompt_token_ids=list(o.prompt_token_ids),
                num_cached_tokens=o.num_cached_tokens,
                finish_reason=c.finish_reason,
                logprobs=_lp(c.logprobs),
                prompt_logprobs=_lp(o.prompt_logprobs),
            )
        )
    return recs


def _metrics(llm):
    found = {name: 0.0 for name in COUNTERS}
    for m in llm.get_metrics():
        if m.name in found and hasattr(m, "value"):
            found[m.name] += float(m.value)
    return found


def _params(raw: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    raw = dict(raw)
    if "structured_outputs" in raw:
        raw["structured_outputs"] = StructuredOutputsParams(**raw["structured_outputs"])
    return SamplingParams(**raw)


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM
    from vllm.platforms import current_platform

    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(**spec["engine"])
    result = {"platform": type(current_platform).__name__, "startup_s": time.perf_counter() - t0, "jobs": []}
    for job in spec["jobs"]:
        t = time.perf_counter()
        if job["kind"] == "generate":
            outs = llm.generate(job["prompts"], _params(job.get("params", {})), use_tqdm=False)
            out = _records(outs)
        elif job["kind"] == "chat":
            outs = llm.chat(job["messages"], _params(job.get("params", {})), use_tqdm=False)
            out = _records(outs)
        elif job["kind"] == "metrics":
            out = _metrics(llm)
        else:
            raise ValueError(f"unknown job kind {job['kind']!r}")
        result["jobs"].append({"kind": job["kind"], "seconds": time.perf_counter() - t, "out": out})
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
