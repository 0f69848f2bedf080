"""Scheduler policy on synthetic sequences (no model)."""

from tpuserve.kv_cache.block_pool import BlockPool
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.server.scheduler import Scheduler
from tpuserve.server.sequence import SeqStatus, Sequence


def _seq(i, prompt_len):
    return Sequence(
        seq_id=str(i),
        request_id=str(i),
        index=0,
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(),
        seed=0,
        arrival=float(i),
    )


def _run(sched, out):
    """Pretend the model ran: advance computed counts, append a token where a sample is kept."""
    for w in out.work:
        done = w.completes
        w.seq.num_computed += w.num_tokens
        if done:
            w.seq.output_token_ids.append(1)


def test_chunked_prefill_respects_token_budget_and_decodes_first():
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    a, b = _seq(0, 3), _seq(1, 20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(w.seq, w.num_tokens) for w in out.work] == [(a, 3), (b, 5)]
    _run(sched, out)
    out = sched.schedule()  # a decodes (1 token) before b's next chunk (7)
    assert [(w.seq, w.num_tokens) for w in out.work] == [(a, 1), (b, 7)]
    assert sum(w.num_tokens for w in out.work) <= 8


def test_max_num_seqs_limits_running():
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [_seq(i, 2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [w.seq for w in out.work] == seqs[:2] and len(sched.waiting) == 1


def test_preemption_frees_newest_and_requeues_it_first():
    pool = BlockPool(5, 4)  # 4 usable pages
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = _seq(0, 8), _seq(1, 8)  # 2 pages each: pool full
    sched.add(a)
    sched.add(b)
    _run(sched, sched.schedule())
    assert pool.num_free == 0
    out = sched.schedule()  # a needs a third page for its decode: b is preempted
    assert out.preempted == [b] and b.status is SeqStatus.WAITING and b.num_computed == 0
    assert [w.seq for w in out.work] == [a]
    assert sched.waiting[0] is b and b.page_ids == []


def test_finish_releases_pages():
    pool = BlockPool(10, 4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100)
    a = _seq(0, 9)
    sched.add(a)
    sched.schedule()
    assert pool.num_free == 6
    sched.finish(a)
    assert pool.num_free == 9 and a.is_finished and not sched.has_work()


# ---- prefix caching ----


def _req(rid, tokens, index=0, salt=None, **params):
    return Sequence(
        seq_id=f"{rid}#{index}",
        request_id=rid,
        index=index,
        prompt_token_ids=list(tokens),
        params=SamplingParams(**params),
        seed=0,
        arrival=0.0,
        cache_salt=salt,
    )


def _drain(sched):
    """Run everything to completion with one output token per sequence, then finish it."""
    while sched.has_work():
        out = sched.schedule()
        _run(sched, out)
        for w in out.work:
            if w.seq.output_token_ids:
                sched.finish(w.seq)


class _FakeHostTier:
    def __init__(self, hashes):
        self.hashes = set(hashes)

    def match(self, hashes):
        n = 0
        while n < len(hashes) and hashes[n] in self.hashes:
            n += 1
        return n


def test_exact_hit_accounting_on_scripted_sequences():
    pool = BlockPool(32, 4, enable_caching=True)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(100, 110))  # 10 tokens: 2 full pages + 2
    a = _req("a", prompt)
    sched.add(a)
    _drain(sched)
    b = _req("b", prompt)  # same prompt: 2 full pages hit, the last 2 tokens computed
    sched.add(b)
    out = sched.schedule()
    assert [(w.seq, w.num_tokens) for w in out.work] == [(b, 2)] and b.num_cached_tokens == 8
    _run(sched, out)
    sched.finish(b)
    c = _req("c", prompt[:8])  # exactly 2 pages: the last token is recomputed, so 1 page hits
    d = _req("d", prompt[:5] + [7, 7, 7, 7, 7])  # diverges inside page 1: 1 page hits
    e = _req("e", prompt, salt="tenant-2")  # another salt: nothing shared
    for s in (c, d, e):
        sched.add(s)
    out = sched.schedule()
    assert [(w.seq.request_id, w.num_tokens) for w in out.work] == [("c", 4), ("d", 6), ("e", 10)]
    assert (c.num_cached_tokens, d.num_cached_tokens, e.num_cached_tokens) == (4, 4, 0)
    st = sched.prefix_stats
    assert (st.queries, st.hits) == (10 + 10 + 8 + 10 + 10, 8 + 4 + 4)
    assert c.page_ids[0] == d.page_ids[0]
    assert pool.ref_count(c.page_ids[0]) == 2  # shared by c and d


def test_hits_share_pages_and_pages_free_exactly():
    pool = BlockPool(16, 4, enable_caching=True)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(13))
    seqs = [_req(str(i), prompt) for i in range(5)]
    sched.add(seqs[0])
    out = sched.schedule()
    _run(sched, out)
    for s in seqs[1:]:
        sched.add(s)
    out = sched.schedule()
    heads = {tuple(s.page_ids[:3]) for s in seqs}
    assert len(heads) == 1  # all five share the three full prompt pages
    assert all(w.num_tokens == 1 for w in out.work if w.seq is not seqs[0])
    _run(sched, out)
    for s in seqs:
        sched.finish(s)
    assert pool.num_free == pool.num_usable and pool.num_cached == 3


def test_n_completions_prefill_once():
    pool = BlockPool(64, 4, enable_caching=True)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=8)  # the prompt takes 3 steps
    prompt = list(range(20))
    sibs = [_req("r", prompt, index=i) for i in range(3)]
    for s in sibs:
        sched.add(s)
    prefill = 0
    while any(not s.output_token_ids for s in sibs):
        out = sched.schedule()
        prefill += sum(max(0, min(w.num_tokens, 20 - w.seq.num_computed)) for w in out.work)
        _run(sched, out)
    # The prompt once; each sibling then hits 4 of its 5 full pages (its last token must be
    # computed, so its last page is too).
    assert prefill == 20 + 4 + 4
    assert sched.prefix_stats.hits == 2 * 16


def test_host_tier_hits_become_loads_into_fresh_pages():
    pool = BlockPool(32, 4, enable_caching=True)
    prompt = list(range(50, 62))  # 3 full pages
    first = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a = _req("a", prompt)
    first.add(a)
    _drain(first)
    hashes = list(a.page_hashes)
    pool.reset_cache()  # the device forgot everything; the host holds pages 1 and 2 (not page 0)
    host = _FakeHostTier(hashes[:2])
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, host_tier=host)
    b = _req("b", prompt)
    sched.add(b)
    out = sched.schedule()
    assert out.loads == [(hashes[0], b.page_ids[0]), (hashes[1], b.page_ids[1])]
    assert [(w.seq, w.num_tokens) for w in out.work] == [(b, 4)]  # (12 - 1) // 4 = 2 pages usable
    assert pool.match(hashes[:2]) == b.page_ids[:2]  # findable on the device from now on
    st = sched.prefix_stats
    assert (st.hits, st.host_queries, st.host_hits) == (8, 12, 8)


def test_evictions_are_reported_for_the_host_tier():
    pool = BlockPool(5, 4, enable_caching=True, record_evictions=True)  # 4 usable pages
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a = _req("a", range(8))
    sched.add(a)
    _drain(sched)
    a_pages = list(zip(a.page_hashes, [p for p in range(1, 5) if pool.page_hash(p)]))
    b = _req("b", range(100, 116))  # needs all 4 pages: evicts a's two cached pages
    sched.add(b)
    out = sched.schedule()
    assert sorted(out.evicted) == sorted(a_pages)
    assert pool.match(a.page_hashes) == []


def test_preempted_sequence_reuses_its_own_cached_pages():
    pool = BlockPool(9, 4, enable_caching=True)  # 8 usable pages
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=64)
    a, b = _req("a", range(12)), _req("b", range(200, 212))
    sched.add(a)
    sched.add(b)
    _run(sched, sched.schedule())  # 3 pages each, one token out each
    for _ in range(5):  # decodes fill both 4th pages, then a 5th page is needed
        out = sched.schedule()
        _run(sched, out)
    assert sched.num_preemptions >= 1
    victim = b if b.status is SeqStatus.WAITING else a
    sched.finish(a if victim is b else b)
    out = sched.schedule()
    (w,) = out.work
    assert w.seq is victim and victim.num_computed >= 12  # its full pages came back from the cache
