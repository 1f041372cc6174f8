"""Step planning: token budget, group affinity, balancing, closing micro-batches, oversize
drops, leftovers and the batch/* metrics."""

from __future__ import annotations

import logging

import pytest
from grpo_agent.train.batching import StepPlanner, attention_cost, plan_step


def _group(factory, group_id, prompt_len=8, completion_lens=(4, 4, 4)):
    prompt = [10 + group_id] + list(range(20, 20 + prompt_len - 1))
    out = []
    for i, n in enumerate(completion_lens):
        comp = [50 + i] * n
        out.append(factory(prompt + comp, [0] * prompt_len + [1] * n, group_id=group_id, seed=i))
    return out


def test_group_stays_in_one_row_and_shares_its_prompt(sample_factory):
    samples = _group(sample_factory, 0) + _group(sample_factory, 1)
    plan = plan_step(samples, token_budget=100, num_processes=2, grad_accum_steps=1)
    (mb,) = plan.microbatches
    assert sorted(r.group_ids for r in mb) == [[0, 0, 0], [1, 1, 1]]
    # 8-token prompt minus its last token shared by 3 samples of 12 tokens each
    assert [r.num_tokens for r in mb] == [7 + 3 * 5] * 2
    m = plan.metrics
    assert m["batch/packing_ratio"] == pytest.approx(72 / 44)
    assert m["batch/samples_per_step"] == 6 and m["batch/groups_per_step"] == 2
    assert m["batch/samples_per_row"] == 3 and m["batch/row_imbalance"] == pytest.approx(1.0)
    assert m["batch/row_fill_frac"] == pytest.approx(22 / 100)
    assert m["batch/trained_tokens_per_step"] == 24
    assert m["batch/masked_token_frac"] == pytest.approx((44 - 24) / 44)
    assert m["batch/pad_frac"] == 0.0 and m["batch/dropped_oversize_count"] == 0


def test_full_row_spills_to_an_empty_row_then_closes_the_microbatch(sample_factory):
    # each sample 12 tokens; budget 17 fits one sample plus the 5 new tokens of a sibling
    samples = _group(sample_factory, 0, completion_lens=(4, 4, 4, 4, 4))
    plan = plan_step(samples, token_budget=17, num_processes=2, grad_accum_steps=2)
    # row 0 full -> sample 3 opens the empty row 1 (which then holds the group too) ->
    # sample 5 fits nowhere and no row is empty -> micro-batch 2
    assert [[r.num_samples for r in mb] for mb in plan.microbatches] == [[2, 2], [1, 0]]
    assert plan.metrics["batch/microbatches_per_step"] == 2
    assert plan.metrics["batch/pad_frac"] > 0  # the empty row of micro-batch 2
    assert plan.trained_tokens(0) == 16 and plan.leftover == []
    # batch/row_imbalance is the micro-batches' mean: 1.0 (two equal rows) and 2.0 (one row
    # beside an empty one, whose process idles)
    assert plan.metrics["batch/row_imbalance"] == pytest.approx(1.5)


def test_step_full_returns_leftovers_in_order(sample_factory):
    samples = [sample_factory(list(range(1, 11)), [0] * 5 + [1] * 5, group_id=g) for g in range(5)]
    plan = plan_step(samples, token_budget=10, num_processes=1, grad_accum_steps=3)
    assert [mb[0].group_ids for mb in plan.microbatches] == [[0], [1], [2]]
    assert [s.group_id for s in plan.leftover] == [3, 4]


def test_oversize_samples_are_dropped_counted_and_warned(sample_factory, caplog):
    ok = sample_factory(list(range(1, 9)), [0] * 4 + [1] * 4, group_id=0)
    big = sample_factory(list(range(1, 40)), [0] * 4 + [1] * 35, group_id=1)
    with caplog.at_level(logging.WARNING):
        plan = plan_step([ok, big], token_budget=16, num_processes=1, grad_accum_steps=1)
    assert plan.dropped == [big] and plan.metrics["batch/dropped_oversize_count"] == 1
    assert "longer than token_budget=16" in caplog.text
    assert plan.samples == 1


def test_a_step_warns_once_however_many_samples_it_drops_as_oversize(sample_factory, caplog):
    """A run whose samples were all longer than token_budget logged 'Dropping a sample of 406
    tokens' 6,260 times in 8 minutes; the count is in batch/dropped_oversize_count."""
    bigs = [sample_factory(list(range(1, 40)), [0] * 4 + [1] * 35, group_id=i) for i in range(3)]
    with caplog.at_level(logging.WARNING):
        plan = plan_step(bigs, token_budget=16, num_processes=1, grad_accum_steps=1)
    assert plan.metrics["batch/dropped_oversize_count"] == 3
    assert caplog.text.count("Dropping a sample") == 1


def test_new_groups_balance_attention_cost_across_processes(sample_factory):
    lengths = [40, 10, 10, 10, 10, 30]
    samples = [
        sample_factory(list(range(1, n + 1)), [0] * 2 + [1] * (n - 2), group_id=g)
        for g, n in enumerate(lengths)
    ]
    # distinct first tokens so nothing is shared
    for g, s in enumerate(samples):
        s.sequence.token_ids[0] = 1000 + g
    plan = plan_step(samples, token_budget=200, num_processes=2, grad_accum_steps=1)
    costs = sorted(attention_cost(r) for r in plan.microbatches[0])
    naive_split = sorted(
        [sum(n * (n + 1) // 2 for n in lengths[:3]), sum(n * (n + 1) // 2 for n in lengths[3:])]
    )
    assert costs[1] / sum(costs) < naive_split[1] / sum(naive_split)
    assert plan.metrics["batch/row_imbalance"] < 1.2


def test_a_group_spills_into_another_process_row_up_to_the_costliest_row(sample_factory):
    """A sample whose group's row is full goes to the cheapest other row while that row's cost
    stays within the costliest row's (equal included), else to a new micro-batch."""
    def add(planner, n, group, first):
        tokens = list(range(first, first + n))
        return planner.add(sample_factory(tokens, [0, 0] + [1] * (n - 2), group_id=group))

    # row 1 would cost 15 + 6 = 21 (the costliest row's own cost), or 15 + 15 = 30 (past it)
    for budget, spill, micro_batches in ((8, 3, 1), (10, 5, 2)):
        planner = StepPlanner(token_budget=budget, num_processes=2, grad_accum_steps=2)
        add(planner, 6, 0, 100)  # row 0: cost 21, 6 tokens
        add(planner, 5, 1, 200)  # row 1: cost 15, 5 tokens
        add(planner, spill, 0, 300)  # fits row 1's tokens, not row 0's
        assert len(planner.plan().microbatches) == micro_batches


def test_streaming_planner_says_when_full(sample_factory):
    planner = StepPlanner(token_budget=10, num_processes=1, grad_accum_steps=1)
    first = sample_factory(list(range(1, 9)), [0] * 4 + [1] * 4, group_id=0)
    second = sample_factory(list(range(11, 19)), [0] * 4 + [1] * 4, group_id=1)
    assert planner.add(first) is True
    assert planner.add(second) is False and planner.full
    # a full step stays full: a sample that would still fit waits for the next step
    assert planner.add(sample_factory([30, 31], [0, 1], group_id=2)) is False
    assert planner.plan().samples == 1


def test_bad_arguments_are_named(sample_factory):
    with pytest.raises(ValueError, match="token_budget=0"):
        StepPlanner(token_budget=0, num_processes=1, grad_accum_steps=1)
    with pytest.raises(ValueError, match="num_processes=0"):
        StepPlanner(token_budget=8, num_processes=0, grad_accum_steps=1)
    with pytest.raises(ValueError, match="grad_accum_steps=0"):
        StepPlanner(token_budget=8, num_processes=1, grad_accum_steps=0)


def test_a_new_group_goes_to_the_row_where_it_adds_least_cost(sample_factory):
    """Placement rule 2 counts what the sample adds, not the row's cost alone: a new group
    whose prompt is another row's (a shared system prompt) costs one token there."""
    planner = StepPlanner(token_budget=100, num_processes=2, grad_accum_steps=1)
    planner.add(sample_factory(list(range(1, 11)), [0] * 8 + [1, 1], group_id=0))  # row 0: 55
    planner.add(sample_factory(list(range(201, 209)), [0, 0] + [1] * 6, group_id=1))  # row 1: 36
    # row 0 shares its 10 tokens: 55 + 11; row 1 would forward all 11: 36 + 66
    planner.add(sample_factory(list(range(1, 12)), [0] * 10 + [1], group_id=2))
    assert [r.group_ids for r in planner.plan().microbatches[0]] == [[0, 2], [1]]


def test_a_group_spills_into_an_empty_row_even_past_the_costliest_row(sample_factory):
    """Rule 3: while some process has an empty row, a sample whose group's row is full goes
    there, whatever it costs; closing the micro-batch instead would leave that process idle."""
    planner = StepPlanner(token_budget=10, num_processes=2, grad_accum_steps=2)
    planner.add(sample_factory(list(range(100, 106)), [0, 0] + [1] * 4, group_id=0))  # cost 21
    planner.add(sample_factory(list(range(200, 210)), [0, 0] + [1] * 8, group_id=0))  # cost 55
    assert [[r.num_samples for r in mb] for mb in planner.plan().microbatches] == [[1, 1]]


def test_plan_step_places_a_group_whole_before_the_next_group(sample_factory):
    """Samples are planned group by group, groups in order of their first sample: a group
    that arrived interleaved with another still trains together (its prompt forwarded once),
    and the group that does not fit waits whole."""
    g0a, g0b = _group(sample_factory, 0, completion_lens=(4, 4))
    (g1,) = _group(sample_factory, 1, completion_lens=(4,))
    # 17 tokens hold g0a and g0b (12 + 5 past their shared prompt), not g0a and g1 (12 + 12)
    plan = plan_step([g0a, g1, g0b], token_budget=17, num_processes=1, grad_accum_steps=1)
    assert plan.microbatches[0][0].group_ids == [0, 0]
    assert plan.leftover == [g1]


def test_metrics_of_a_step_that_leaves_a_process_row_empty(sample_factory):
    """An empty row is a process forwarding padding: row_fill_frac, pad_frac and row_imbalance
    count it; samples_per_row and row_tokens_mean describe the rows that hold samples."""
    one = sample_factory(list(range(1, 11)), [0, 0] + [1] * 8)
    m = plan_step([one], token_budget=20, num_processes=2, grad_accum_steps=1).metrics
    assert m["batch/samples_per_row"] == 1.0
    assert m["batch/row_tokens_mean"] == 10.0 and m["batch/row_tokens_max"] == 10.0
    assert m["batch/row_fill_frac"] == pytest.approx(10 / 20 / 2)
    assert m["batch/pad_frac"] == pytest.approx(0.5)  # 10 pad tokens of 2 x 10
    assert m["batch/row_imbalance"] == pytest.approx(2.0)  # costs 55 and 0


def test_a_step_whose_samples_were_all_dropped_plans_no_microbatch(sample_factory):
    big = sample_factory(list(range(1, 40)), [0] * 4 + [1] * 35)
    plan = plan_step([big], token_budget=16, num_processes=2, grad_accum_steps=2)
    assert plan.microbatches == [] and plan.dropped == [big]
    m = plan.metrics
    assert m["batch/microbatches_per_step"] == 0 and m["batch/forwarded_tokens_per_step"] == 0
    assert m["batch/packing_ratio"] == 1.0  # nothing shared
