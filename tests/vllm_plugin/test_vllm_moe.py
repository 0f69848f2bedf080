"""Mixture-of-experts models through vLLM with the plugin active.

The main suite's tiny MoE checkpoints (moe_checkpoints.py): Qwen3-MoE, gpt-oss with f32 experts,
gpt-oss with its experts as the published MXFP4 blocks/scales (``quant_method: mxfp4``, which
vLLM renames ``gpt_oss_mxfp4``). The first two run through ``vllm.LLM`` in a child process
(vllm_driver.py), the MXFP4 one through ``vllm serve --device tpu`` (completions on token ids).
Each must give our standalone engine's greedy tokens on the same checkpoint and prompt ids, with
the same page count, step budget (16 tokens: vLLM chunks every longer prompt) and dtype. The
gpt-oss runs also send two prompts sharing a long prefix one after the other: the second must be
served from vLLM's prefix cache (reported cached tokens) with the tokens our engine computes,
across gpt-oss's 4-token sliding-window layers, whose windows vLLM's KV spec must carry per layer.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one
pytest.importorskip("openai")

from moe_checkpoints import build_all
from vllm_helpers import PROMPTS, resolve_engine_configs, run_driver
from vllm_server import vllm_servers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

MAX_TOKENS = 16
PAGES = 48  # vLLM's num_gpu_blocks_override and our engine's num_gpu_blocks: the same KV cache
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16, block_size=16)
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PREFIX = (
    "Background notes. The museum opens at nine in the morning and closes at six in the "
    "evening. Tickets cost twelve euros for adults and six for children. The east wing holds "
    "paintings from the seventeenth century. "
)
SHARED = [PREFIX + "Question: When does the museum open?\nAnswer:", PREFIX + "Question: Who?\nAnswer:"]
# The worker's log line for the per-layer windows it reports to vLLM (test_gpt_oss.py's config).
GPT_OSS_WINDOWS = "sliding windows by layer [4, None, 4, None]"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_all(str(tmp_path_factory.mktemp("vllm-moe")))


def ours(path: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Our standalone engine's greedy tokens, with the vLLM runs' cache and step settings."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = LLM(path, dtype="float32", num_gpu_blocks=PAGES, warmup=False, **ENGINE)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _offline(path: str, workdir: str) -> dict:
    jobs = [{"kind": "generate", "prompts": PROMPTS, "params": GREEDY}]
    # one at a time, so the second finds the first's pages in vLLM's prefix cache
    jobs += [{"kind": "generate", "prompts": [p], "params": GREEDY} for p in SHARED]
    jobs.append({"kind": "metrics"})
    engine = dict(
        model=path,
        dtype="float32",
        seed=0,
        num_gpu_blocks_override=PAGES,
        enable_prefix_caching=True,
        disable_log_stats=False,
        **ENGINE,
    )
    return run_driver({"engine": engine, "jobs": jobs}, workdir)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_offline_greedy_equals_our_engine(kind, checkpoints, tmp_path):
    run = _offline(checkpoints[kind], str(tmp_path))
    log = run["log"]
    assert run["platform"] == "TpuservePlatform"
    assert "weights: dense" in log, log[-3000:]
    assert (GPT_OSS_WINDOWS in log) == (kind == "gpt_oss"), log[-3000:]
    recs = [r for job in run["jobs"] if job["kind"] == "generate" for r in job["out"]]
    prompt_ids = [r["prompt_token_ids"] for r in recs]
    assert max(len(p) for p in prompt_ids) > 2 * ENGINE["max_num_batched_tokens"]  # chunked prefill
    for r, m in zip(recs, ours(checkpoints[kind], prompt_ids)):
        assert len(r["token_ids"]) == MAX_TOKENS
        assert r["token_ids"] == m, f"vLLM+plugin vs our engine on {kind}"
    first, second = recs[-2], recs[-1]
    assert first["num_cached_tokens"] == 0
    # The shared prefix spans several full 16-token pages, far past gpt-oss's 4-token window.
    assert second["num_cached_tokens"] >= 2 * 16, second["num_cached_tokens"]
    assert run["jobs"][-1]["out"]["vllm:prefix_cache_hits"] >= second["num_cached_tokens"]


def test_serve_gpt_oss_mxfp4_greedy_equals_our_engine(checkpoints, tmp_path):
    path = checkpoints["gpt_oss_mxfp4"]
    args = [path, "--dtype", "float32", "--seed", "0", "--num-gpu-blocks-override", str(PAGES)]
    for key, value in ENGINE.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    with vllm_servers([(args, tmp_path / "serve.log", None)]) as (srv,):
        got = []
        for prompt in [*PROMPTS, *SHARED]:  # one at a time: the last one hits the prefix cache
            r = srv.client.completions.create(
                model="m",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            extra = r.choices[0].model_extra
            got.append((extra["prompt_token_ids"], extra["token_ids"]))
        counters = srv.counters()
        log = srv.log(tail=200_000)
    # vLLM took the checkpoint's MXFP4 name and our worker kept its experts as MXFP4 records.
    assert "weights: mxfp4" in log, log[-4000:]
    assert GPT_OSS_WINDOWS in log, log[-4000:]
    mine = ours(path, [p for p, _ in got])
    for (_, tokens), m in zip(got, mine):
        assert tokens == m, "vllm serve + plugin vs our engine on gpt-oss MXFP4"
    assert counters["vllm:prefix_cache_hits_total"] >= 2 * 16, counters


def test_config_time_names_and_refusals(checkpoints):
    """vLLM's config for the MoE checkpoints with the plugin active (no engine started): the MXFP4
    gpt-oss accepted under its checkpoint's method name, held by our marker config; --quantization on an MoE
    model refused by name before any weight is read."""
    cases = [
        (checkpoints["gpt_oss_mxfp4"], {}),
        (checkpoints["gpt_oss"], {}),
        (checkpoints["qwen3_moe"], dict(quantization="fp8")),
    ]
    lines = resolve_engine_configs(cases)
    mxfp4, dense, qwen_fp8 = lines
    # the checkpoint's name, or vLLM's rename of it for gpt-oss (its config hook runs on hf_config)
    assert mxfp4 in (
        "ACCEPTED mxfp4 TpuserveQuantConfig auto",
        "ACCEPTED gpt_oss_mxfp4 TpuserveQuantConfig auto",
    ), mxfp4
    assert dense == "ACCEPTED None NoneType auto", dense
    assert qwen_fp8.startswith("REFUSED"), qwen_fp8
    assert "quantization='fp8' with a mixture-of-experts model (Qwen3MoeForCausalLM)" in qwen_fp8, qwen_fp8
