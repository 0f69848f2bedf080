"""``vllm serve --device tpu --speculative-config '{"method": "ngram", ...}'``: vLLM's speculation
contract over our runner's draft verification.

Two servers of the default model run side by side, one speculating and one not. Oracles are
vLLM's own: greedy completions (and their logprobs, penalties, grammar) must equal the plain
server's; vLLM's spec-decode counters on ``/metrics`` (filed by its scheduler from the tokens our
worker returned) must show drafts accepted; and vLLM's config check must refuse other methods.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one
pytest.importorskip("openai")
pytest.importorskip("httpx")

from vllm_helpers import SCAN_ARGS, child_env
from vllm_server import serve_cmd, vllm_servers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SPEC = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2,"prompt_lookup_max":4}'
COMMON = [
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "64",
    *SCAN_ARGS,
]
# Input-grounded prompts: the continuation repeats what the prompt holds, so n-grams match.
REPETITIVE = [
    "Repeat the list exactly.\nList: apple, banana, cherry, grape, lemon, mango, peach, plum.\n"
    "Repeated list: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Copy the sentence three times.\nThe red fox runs over the green hill at dawn.\n"
    "The red fox runs over the green hill at dawn.\n",
]


@pytest.fixture(scope="module")
def servers(default_hf_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-spec")
    with vllm_servers(
        [
            ([default_hf_dir, *COMMON], logs / "plain.log", None),
            ([default_hf_dir, *COMMON, "--speculative-config", SPEC], logs / "spec.log", None),
        ]
    ) as (plain, spec):
        yield plain, spec


def _complete(srv, prompt: str, **kw):
    extra = kw.pop("extra_body", None)
    r = srv.client.completions.create(model="m", prompt=prompt, temperature=0, extra_body=extra, **kw)
    return r.choices[0]


def _spec_counters(srv) -> dict[str, float]:
    c = srv.counters()
    return {
        k: c.get(f"vllm:spec_decode_{k}_total", 0.0)
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }


def test_greedy_output_equals_plain_and_vllm_counts_accepted_drafts(servers):
    plain, spec = servers
    before = _spec_counters(spec)
    for p in REPETITIVE:
        want = _complete(plain, p, max_tokens=40).text
        got = _complete(spec, p, max_tokens=40).text
        assert got == want, (p[:30], got, want)
    after = _spec_counters(spec)
    drafts = after["num_drafts"] - before["num_drafts"]
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafts > 0 and 0 < accepted <= drafted <= 3 * drafts, after
    assert _spec_counters(plain)["num_drafts"] == 0


def test_concurrent_mixed_batch_equals_plain(servers):
    """Drafting and non-drafting requests share steps: logprobs per generated token, a penalty
    (counts the drafts before each position), a grammar (verifies no drafts) and random sampling."""
    plain, spec = servers
    jobs = [(p, dict(max_tokens=32)) for p in REPETITIVE]
    jobs += [
        (REPETITIVE[0], dict(max_tokens=24, logprobs=2)),
        (REPETITIVE[1], dict(max_tokens=24, extra_body={"repetition_penalty": 1.3})),
        (
            "Count: 1, 2, 3, 1, 2, 3, 1, 2,",
            dict(max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}),
        ),
    ]

    def run(srv):
        with ThreadPoolExecutor(len(jobs) + 1) as pool:
            random = pool.submit(
                srv.client.completions.create,
                model="m",
                prompt=REPETITIVE[2],
                max_tokens=16,
                temperature=0.8,
                seed=7,
            )
            outs = list(pool.map(lambda j: _complete(srv, j[0], **j[1]), jobs))
            return outs, random.result().choices[0]

    want, _ = run(plain)
    got, sampled = run(spec)
    for (prompt, kw), g, w in zip(jobs, got, want):
        assert g.text == w.text, (prompt[:30], kw, g.text, w.text)
        if kw.get("logprobs"):
            assert g.logprobs.tokens == w.logprobs.tokens
            assert g.logprobs.token_logprobs == pytest.approx(w.logprobs.token_logprobs, abs=1e-3)
            for a, b in zip(g.logprobs.top_logprobs, w.logprobs.top_logprobs):
                assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-3)
    assert len(got[-1].text) == 3 and got[-1].text.isdigit()
    assert sampled.finish_reason in ("length", "stop")  # random sampling through verification runs


@pytest.mark.timeout(300)
def test_eagle3_is_refused_by_name(default_hf_dir):
    # (MTP on a model without MTP layers is refused by vLLM itself before the platform is asked;
    # test_vllm_spec_decode_table.py covers our message for every other method.)
    method = "eagle3"
    cfg = f'{{"method":"{method}","num_speculative_tokens":2,"model":"{default_hf_dir}"}}'
    proc = subprocess.run(
        serve_cmd(default_hf_dir, 1, *COMMON, "--speculative-config", cfg),
        env=child_env(plugin=False),
        capture_output=True,
        text=True,
        timeout=280,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"method={method!r}" in log and "'ngram' only" in log, log[-4000:]
