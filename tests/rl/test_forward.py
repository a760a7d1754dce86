"""The forward-process helpers of flowrl/rl/forward.py and the group-aware passes: training times by mode and by
who shares them, shared noise, whole-group micro-batches, minibatch partitions that agree across processes."""

import pytest
import torch

from flowrl.config import ConfigError, from_dict
from flowrl.rl.forward import TimesConfig, draw_times, forward_noise, schedule_positions
from flowrl.rl.passes import MetricMeans, minibatch_rows, pass_layout, stage_rows, training_passes

SIGMAS = torch.linspace(1.0, 0.0, 11)  # a 10-step schedule: positions 0..9 are 1.0, 0.9, ..., 0.1
GROUPS = torch.arange(12) // 4  # 3 groups of 4
SAMPLES = torch.arange(12)


class OneProcess:
    world_size, rank = 1, 0

    @staticmethod
    def gather(t):
        return t


def test_schedule_positions_round_the_fraction_range():
    assert schedule_positions(10, 0.0, 1.0) == list(range(10))
    assert schedule_positions(10, 0.0, 0.5) == [0, 1, 2, 3, 4]  # DGPO: the first half
    assert schedule_positions(14, 1 / 14, 12 / 14) == list(range(1, 12))  # AWM's positions 1-11 of 14


def test_schedule_times_are_distinct_positions_shared_as_configured():
    cfg = TimesConfig(count=3, mode="schedule", high=0.5, share="group")
    t = draw_times(cfg, SIGMAS, GROUPS, SAMPLES, seed=0, epoch=0)
    assert t.shape == (12, 3)
    allowed = {round(float(s), 6) for s in SIGMAS[:5]}
    for row in t:
        assert {round(float(x), 6) for x in row} <= allowed and len(set(row.tolist())) == 3  # without replacement
    assert all(torch.equal(t[i], t[4 * (i // 4)]) for i in range(12))  # one draw per group
    assert not torch.equal(t[0], t[4]) or not torch.equal(t[4], t[8])
    again = draw_times(cfg, SIGMAS, GROUPS[4:], SAMPLES[4:], seed=0, epoch=0)  # another process's rows
    assert torch.equal(again, t[4:])
    assert not torch.equal(draw_times(cfg, SIGMAS, GROUPS, SAMPLES, seed=0, epoch=1), t)
    batch = draw_times(TimesConfig(count=2, share="batch"), SIGMAS, GROUPS, SAMPLES, seed=0, epoch=0)
    assert (batch == batch[0]).all()


def test_stratified_times_take_one_position_per_stratum():
    cfg = TimesConfig(count=2, mode="stratified", share="sample")
    t = draw_times(cfg, SIGMAS, GROUPS, SAMPLES, seed=3, epoch=0)
    # Strata of positions 0-4 (sigma 1.0-0.6) and 5-9 (sigma 0.5-0.1).
    assert ((t[:, 0] > 0.55) & (t[:, 1] < 0.55)).all()
    uniform = draw_times(TimesConfig(count=4, mode="uniform", low=0.2, high=0.4), SIGMAS, GROUPS, SAMPLES, seed=0,
                         epoch=0)
    assert ((uniform >= 0.2) & (uniform < 0.4)).all() and uniform.unique().numel() == 48


def test_too_few_positions_and_an_empty_range_are_config_errors():
    with pytest.raises(ConfigError, match=r"train\.times\.count: 6 times per sample, but only 5 positions"):
        TimesConfig(count=6, high=0.5).check_schedule(10)
    with pytest.raises(ConfigError, match=r"high: 0\.2 must exceed low = 0\.5"):
        from_dict(TimesConfig, {"low": 0.5, "high": 0.2})


def test_forward_noise_depends_only_on_the_id_and_is_shared_by_equal_ids():
    ids = torch.tensor([7, 7, 9])
    eps = forward_noise((2, 3), ids, seed=1, epoch=2, inner=0, unit=1)
    assert torch.equal(eps[0], eps[1]) and not torch.equal(eps[0], eps[2])
    assert torch.equal(forward_noise((2, 3), torch.tensor([9]), seed=1, epoch=2, inner=0, unit=1)[0], eps[2])
    assert not torch.equal(forward_noise((2, 3), ids, seed=1, epoch=2, inner=0, unit=0), eps)


def test_whole_group_micro_batches_and_padding():
    rows = torch.tensor([0, 1, 2, 3, 5, 6, 8, 9, 10, 11])  # group 1 lost rows 4 and 7 (NaN rewards)
    passes = training_passes(rows, [0, 1], 6, OneProcess(), groups=GROUPS)
    micro = [p.rows.tolist() for p in passes if p.unit == 0]
    assert micro == [[0, 1, 2, 3, 5, 6], [8, 9, 10, 11]]  # whole groups, as many as fit in 6 rows
    assert [p.sync for p in passes] == [False, False, False, True]
    # An empty minibatch makes no pass of zero rows (an empty tensor splits into one empty chunk).
    empty = training_passes(torch.zeros(0, dtype=torch.long), [0], 4, OneProcess())
    assert len(empty) == 0


def test_each_pass_reads_a_contiguous_slice_of_the_staged_minibatch():
    """A minibatch is staged on the device once, in pass_layout's order; every pass (a micro-batch at each unit,
    whole groups, a padding pass) reads a slice of it that holds exactly its rows."""
    data = torch.arange(12.0)[:, None] * torch.tensor([1.0, 10.0])  # [n, 2]: row r holds (r, 10 r)
    rows = torch.tensor([0, 1, 2, 3, 5, 6, 8, 9, 10, 11])
    for passes in (training_passes(rows, [0, 1], 6, OneProcess(), groups=GROUPS),
                   training_passes(rows[torch.randperm(10, generator=torch.Generator().manual_seed(0))], [0, 1, 2],
                                   3, OneProcess())):
        order, slices = pass_layout(passes)
        staged = stage_rows(data, order, "cpu")
        assert len(slices) == len(passes) and staged.is_contiguous()
        for p, sl in zip(passes, slices):
            assert torch.equal(staged[sl], data[p.rows])
        assert len(order) == len(rows)  # each row staged once: the units of a micro-batch share its slice
    padding = [*passes, type(passes[0])(rows=passes[0].rows[:1], unit=0, weight=0.0, sync=True)]
    order, slices = pass_layout(padding)
    assert slices[-1] == slice(0, 1) and len(order) == len(rows)  # a prefix of the first micro-batch
    overlap = [type(passes[0])(rows=torch.tensor(r), unit=0, weight=1.0, sync=False) for r in ([3, 4], [4, 5], [3, 4])]
    order, slices = pass_layout(overlap)
    assert order.tolist() == [3, 4, 4, 5] and slices == [slice(0, 2), slice(2, 4), slice(0, 2)]
    steps = stage_rows(torch.arange(24.0).reshape(12, 2), order, "cpu", transpose=True)  # [units, k]
    assert steps.is_contiguous() and torch.equal(steps[1, 0:2], torch.tensor([7.0, 9.0]))
    picked = stage_rows(torch.arange(36.0).reshape(12, 3), torch.tensor([2, 0]), "cpu", dim1=[2, 0], transpose=True)
    assert torch.equal(picked, torch.tensor([[8.0, 2.0], [6.0, 0.0]]))


def test_metric_means_weigh_numbers_and_cpu_tensors_alike():
    means = MetricMeans()
    means.add(2, loss=torch.tensor(1.5), ratio=1.0)
    means.add(1, loss=3.0, ratio=torch.tensor([4.0]))
    assert means.means() == {"loss": (2 * 1.5 + 3.0) / 3, "ratio": (2 * 1.0 + 4.0) / 3}
    assert all(isinstance(v, float) for v in means.sums.values())  # CPU values are read at once (free)
    with pytest.raises(RuntimeError):
        means.add(1, loss=torch.ones(2))  # one value per statistic


def test_minibatch_partition_over_the_global_count_agrees_across_processes():
    whole = minibatch_rows(SAMPLES, 3, seed=0, epoch=1, inner=0, total=12)
    first = minibatch_rows(SAMPLES[:6], 3, seed=0, epoch=1, inner=0, total=12)
    assert [m.tolist() for m in first] == [[i for i in m.tolist() if i < 6] for m in whole]
    by_group = minibatch_rows(GROUPS, 3, seed=0, epoch=1, inner=0, total=3)
    assert sorted(len(m) for m in by_group) == [4, 4, 4] and all(GROUPS[m].unique().numel() == 1 for m in by_group)
