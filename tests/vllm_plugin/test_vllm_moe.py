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

Two more ``vllm serve`` runs: the MXFP4 gpt-oss with n-gram speculative decoding and the host KV
tier together (vLLM's counters must show drafts accepted and prefix tokens reloaded from host
memory, the tokens still our engine's), and Qwen3-MoE with ``--tensor-parallel-size 2
--enable-expert-parallel`` on two fake CPU devices (experts split 4 a device; our engine's
one-device tokens).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one
pytest.importorskip("openai")

import numpy as np
from moe_checkpoints import build_all, build_qwen3_moe_tp
from vllm_helpers import PROMPTS, resolve_engine_configs, run_driver
from vllm_server import fake_devices_env, vllm_servers

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


def ours(path: str, prompt_ids: list[list[int]], llm=None) -> list[list[int]]:
    """Our standalone engine's greedy tokens, with the vLLM runs' cache and step settings
    (``llm``: such an engine already built, to ask it again)."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = llm or LLM(path, dtype="float32", num_gpu_blocks=PAGES, warmup=False, **ENGINE)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _serve_args(path: str, pages: int = PAGES) -> list[str]:
    args = [path, "--dtype", "float32", "--seed", "0", "--num-gpu-blocks-override", str(pages)]
    for key, value in ENGINE.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


def _complete(srv, prompt: str | list[int]):
    """vLLM's greedy completion of a text or token-id prompt, with its token ids."""
    return srv.client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )


def _complete_texts(srv, prompts: list[str]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy tokens) per prompt, one request after the other."""
    out = []
    for prompt in prompts:
        extra = _complete(srv, prompt).choices[0].model_extra
        out.append((extra["prompt_token_ids"], extra["token_ids"]))
    return out


def _complete_ids(srv, prompt_ids: list[int]) -> tuple[list[int], int]:
    """Greedy tokens for a token-id prompt, and the prompt tokens vLLM reports as cached."""
    r = _complete(srv, prompt_ids)
    details = r.usage.prompt_tokens_details
    return r.choices[0].model_extra["token_ids"], (details.cached_tokens or 0) if details else 0


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
    with vllm_servers([(_serve_args(path), tmp_path / "serve.log", None)]) as (srv,):
        got = _complete_texts(srv, [*PROMPTS, *SHARED])  # in turn: the last one hits the prefix cache
        counters = srv.counters()
        log = srv.log(tail=200_000)
    # vLLM took the checkpoint's MXFP4 name and our worker kept its experts as MXFP4 records.
    assert "weights: mxfp4" in log, log[-4000:]
    assert GPT_OSS_WINDOWS in log, log[-4000:]
    mine = ours(path, [p for p, _ in got])
    for (_, tokens), m in zip(got, mine):
        assert tokens == m, "vllm serve + plugin vs our engine on gpt-oss MXFP4"
    assert counters["vllm:prefix_cache_hits_total"] >= 2 * 16, counters


SPEC = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2,"prompt_lookup_max":4}'
HOST = 'source="host"'
OFFLOAD_PAGES = 20  # vLLM reserves block 0: 19 usable, one request's 96 + 16 + 3 tokens take 8


def test_serve_gpt_oss_mxfp4_spec_decode_and_host_tier(checkpoints, tmp_path):
    """n-gram drafts verified by our worker and evicted prefixes reloaded from our host tier, in one
    server: the tokens stay our engine's, vLLM counts accepted drafts and host-sourced prefix
    tokens, and our connector counts the blocks it scattered back.

    Input-grounded prompts for a random-weight model: a random context C, the 16 tokens T our engine
    continues it with, then C again. The drafter finds C's tail earlier in the prompt, followed by
    T; the model, seeing C twice, mostly continues with T again, so drafts are accepted."""
    from tpuserve.server.llm import LLM

    path = checkpoints["gpt_oss_mxfp4"]
    llm = LLM(path, dtype="float32", num_gpu_blocks=PAGES, warmup=False, **ENGINE)
    rng = np.random.default_rng(0)
    contexts = [[int(t) for t in rng.integers(100, 100_000, 40)] for _ in range(2)]
    prompts = [c + t + c for c, t in zip(contexts, ours(path, contexts, llm))]  # 96 tokens: 6 pages
    flood = [[int(t) for t in rng.integers(100, 100_000, 120)] for _ in range(2)]
    want = ours(path, prompts + flood, llm)
    args = [*_serve_args(path, OFFLOAD_PAGES), "--enable-prompt-tokens-details"]
    args += ["--speculative-config", SPEC, "--kv-offloading-size", "1"]
    with vllm_servers([(args, tmp_path / "serve.log", None)]) as (srv,):
        cold = [_complete_ids(srv, p) for p in prompts]  # one at a time throughout
        flooded = [_complete_ids(srv, p) for p in flood]  # 18 pages: the prompts leave the device
        before = srv.counters((HOST,))
        again = [_complete_ids(srv, p) for p in prompts]
        after = srv.counters((HOST,))
        log = srv.log(tail=200_000)
    assert "host-memory KV tier via TpuserveHostOffloadConnector" in log, log[-4000:]
    assert GPT_OSS_WINDOWS in log, log[-4000:]
    assert [t for t, _ in cold + flooded] == want, "vllm serve (spec + host tier) vs our engine"
    assert [t for t, _ in again] == want[: len(prompts)], "reloaded from host vs our engine"
    assert [c for _, c in cold] == [0, 0]
    assert [c for _, c in again] == [5 * 16, 5 * 16]  # the full pages before the last prompt token
    host = f"vllm:prompt_tokens_cached_by_source_total{{{HOST}}}"
    host_tokens = after.get(host, 0.0) - before.get(host, 0.0)
    loaded = after.get("vllm:tpuserve_host_tier_loaded_blocks_total", 0.0) - before.get(
        "vllm:tpuserve_host_tier_loaded_blocks_total", 0.0
    )
    assert host_tokens > 0 and loaded * 16 == host_tokens, (host_tokens, loaded)
    drafted = after.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    accepted = after.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    assert 0 < accepted <= drafted, (accepted, drafted)


def test_serve_qwen3_moe_expert_parallel_over_two_devices(tmp_path):
    """``--tensor-parallel-size 2 --enable-expert-parallel`` on two fake CPU devices: the worker
    splits the 8 experts 4 a device (its log line) and serves our engine's one-device tokens. The
    vocabulary is padded to split over the two devices too."""
    path = build_qwen3_moe_tp(str(tmp_path / "qwen3_moe_tp"))
    args = [*_serve_args(path), "--tensor-parallel-size", "2", "--enable-expert-parallel"]
    with vllm_servers([(args, tmp_path / "serve.log", fake_devices_env(2))]) as (srv,):
        got = _complete_texts(srv, PROMPTS[:3])
        log = srv.log(tail=200_000)
    assert "tensor parallel 2 over mesh {'data': 1, 'model': 2}" in log, log[-4000:]
    assert "expert parallel: 8 experts over 2 devices, 4 each" in log, log[-4000:]
    mine = ours(path, [p for p, _ in got])
    for (_, tokens), m in zip(got, mine):
        assert tokens == m, "vllm serve TP=2 + EP vs our engine on one device"


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
