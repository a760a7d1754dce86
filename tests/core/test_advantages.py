"""Advantage estimators: hand-derived values (derivations in comments) and invariances."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.core.advantages import (
    PerPromptStatTracker,
    combine_rewards,
    gae,
    group_advantages,
    rloo_advantages,
    zero_std_fraction,
)

D = torch.float64


def t(*xs):
    return torch.tensor(xs, dtype=D)


def close(actual, expected, atol=1e-9):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# Four groups with arbitrary, interleaved, negative ids:
#   id 7:   [1, 3]        mean 2, dev [-1, 1],         pop std 1
#   id -2:  [2, 2, 2, 6]  mean 3, dev [-1, -1, -1, 3], pop var (1+1+1+9)/4 = 3, std sqrt(3)
#   id 100: [5]           a group of one -> 0
#   id 4:   [7, 7]        constant -> 0
REWARDS = t(1, 2, 5, 2, 7, 3, 2, 7, 6)
IDS = torch.tensor([7, -2, 100, -2, 4, 7, -2, 4, -2])


def test_group_advantages_hand_values_eps_zero():
    # 1/sqrt(3) = 0.5773502691896258, 3/sqrt(3) = sqrt(3) = 1.7320508075688772
    a, s = 0.5773502691896258, 1.7320508075688772
    expected = [-1.0, -a, 0.0, -a, 0.0, 1.0, -a, 0.0, s]
    close(group_advantages(REWARDS, IDS, eps=0.0), expected)


def test_group_advantages_hand_values_default_eps():
    # id 7: +-1 / (1 + 1e-4) = +-0.99990000999900...; id -2: -1 / (1.7320508075688772 + 1e-4) = -0.57731693778...
    # and 3 / 1.7321508075688772 = 1.73195081334...
    b = 1 / 1.0001  # 0.9999000099990001
    c = 1 / 1.7321508075688772  # 0.5773169377806823
    expected = [-b, -c, 0.0, -c, 0.0, b, -c, 0.0, 3 * c]
    out = group_advantages(REWARDS, IDS)
    close(out, expected)
    close(out[[0, 1, 8]], [-0.9999000099990001, -0.5773169377806823, 1.7319508133420467], atol=1e-12)


def test_group_advantages_batch_and_none_scopes():
    # rewards [0, 2, 4, 6], groups [0, 0, 1, 1]: group means 1, 5 -> centred [-1, 1, -1, 1].
    # Batch: mean 3, dev [-3, -1, 1, 3], pop var 20/4 = 5, std sqrt(5) = 2.23606797749979;
    # 1/sqrt(5) = 0.4472135954999579. (Group std would give +-1, so the scopes are distinguishable.)
    r, g = t(0, 2, 4, 6), torch.tensor([0, 0, 1, 1])
    q = 0.4472135954999579
    close(group_advantages(r, g, std_scope="batch", eps=0.0), [-q, q, -q, q])
    # with eps: 1 / (2.23606797749979 + 1e-4) = 0.4471935963943451
    close(group_advantages(r, g, std_scope="batch"), [-0.4471935963943451, 0.4471935963943451] * 2)
    close(group_advantages(r, g, std_scope="group", eps=0.0), [-1.0, 1.0, -1.0, 1.0])
    # Dr.GRPO: only centred, eps unused.
    close(group_advantages(r, g, std_scope="none"), [-1.0, 1.0, -1.0, 1.0])
    close(group_advantages(REWARDS, IDS, std_scope="none"), [-1, -1, 0, -1, 0, 1, -1, 0, 3])


def test_group_advantages_clip():
    # Ten samples, nine 0 and one 10: mean 1, dev [-1]*9 + [9], pop var (9 + 81)/10 = 9, std 3
    # -> A = [-1/3]*9 + [3].
    r = t(*([0.0] * 9 + [10.0]))
    g = torch.zeros(10, dtype=torch.long)
    close(group_advantages(r, g, eps=0.0, clip=None), [-1 / 3] * 9 + [3.0])
    close(group_advantages(r, g, eps=0.0, clip=2.5), [-1 / 3] * 9 + [2.5])
    close(group_advantages(-r, g, eps=0.0, clip=2.5), [1 / 3] * 9 + [-2.5])


def test_group_of_one_and_zero_std_give_zero():
    r = t(0.1, 0.1, 0.1, 0.3, 42.0)  # 0.1 * 3 is not exactly representable: the mean is not bit-equal
    g = [1, 1, 1, 2, 3]
    for scope in ("group", "batch", "none"):
        out = group_advantages(r, g, std_scope=scope)
        assert torch.equal(out[:3], torch.zeros(3, dtype=D))
        assert torch.equal(out[3:], torch.zeros(2, dtype=D))
    # eps = 0 on a constant group must be 0, not 0 / 0.
    assert torch.equal(group_advantages(r.float(), g, eps=0.0), torch.zeros(5))
    assert torch.equal(rloo_advantages(r, g), torch.zeros(5, dtype=D))


def test_zero_std_fraction():
    # groups 7 and -2 vary; 100 (one sample) and 4 (constant) have zero std -> 2 / 4
    assert zero_std_fraction(REWARDS, IDS) == 0.5
    assert zero_std_fraction(t(1, 1, 2, 3), [0, 0, 1, 1]) == 0.5
    assert zero_std_fraction(t(1, 2), [0, 0]) == 0.0


def test_group_ids_as_list_of_strings_or_ints():
    expected = group_advantages(REWARDS, IDS)
    close(group_advantages(REWARDS, IDS.tolist()), expected)
    close(group_advantages(REWARDS, [f"p{i}" for i in IDS.tolist()]), expected)


def test_constant_shift_and_positive_scale_invariance():
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(24, generator=gen, dtype=D) * 30  # group stds ~ 30 >> eps
    g = torch.arange(6).repeat_interleave(4)
    base, base_rloo = group_advantages(r, g), rloo_advantages(r, g)
    for shift in (-7.5, 1000.0):
        close(group_advantages(r + shift, g), base, atol=1e-9)
        close(rloo_advantages(r + shift, g), base_rloo, atol=1e-9)
    # scale: only eps breaks exactness, relative effect ~ eps / (scale * std) <~ 1e-5
    for scale in (0.5, 10.0):
        torch.testing.assert_close(group_advantages(r * scale, g), base, rtol=1e-4, atol=0)
        close(group_advantages(r * scale, g, eps=0.0), group_advantages(r, g, eps=0.0), atol=1e-12)


def test_rloo_hand_values():
    # [1, 2, 6]: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5
    # [4, 8]:    4 - 8 = -4, 8 - 4 = 4;   [5]: group of one -> 0
    r = t(1, 4, 2, 5, 8, 6)
    g = torch.tensor([3, 9, 3, 0, 9, 3])
    close(rloo_advantages(r, g), [-3.0, -4.0, -1.5, 0.0, 4.0, 4.5])


def test_rloo_two_forms_agree():
    gen = torch.Generator().manual_seed(1)
    r = torch.rand(15, generator=gen, dtype=D)
    g = torch.tensor([0] * 5 + [1] * 3 + [2] * 7)
    out = rloo_advantages(r, g)
    for gid in range(3):
        rg = r[g == gid]
        G = rg.numel()
        loo = torch.stack([rg[i] - (rg.sum() - rg[i]) / (G - 1) for i in range(G)])
        scaled = G / (G - 1) * (rg - rg.mean())
        close(out[g == gid], loo, atol=1e-12)
        close(out[g == gid], scaled, atol=1e-12)


def test_errors():
    with pytest.raises(ValueError, match="std_scope.*'group'.*received 'global'"):
        group_advantages(REWARDS, IDS, std_scope="global")
    with pytest.raises(ValueError, match="group_ids.*\\[9\\].*\\(3,\\)"):
        group_advantages(REWARDS, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="rewards.*1-D.*\\(3, 3\\)"):
        group_advantages(REWARDS.reshape(3, 3), IDS)
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(t(1.0, float("nan")), [0, 0])
    with pytest.raises(ValueError, match="clip"):
        group_advantages(REWARDS, IDS, clip=0)


# ---------------------------------------------------------------------------- PerPromptStatTracker


def test_stat_tracker_batch_fallback_then_history_and_state_dict():
    tr = PerPromptStatTracker(buffer_size=4, min_count=3, eps=0.0, clip=None)
    # Update 1: histories a=[0, 4], b=[1, 3] hold 2 < 3 rewards -> batch statistics.
    # Batch [0, 4, 1, 3]: mean 2, dev [-2, 2, -1, 1], pop var 10/4 = 2.5;
    # 2/sqrt(2.5) = sqrt(1.6) = 1.2649110640673518, 1/sqrt(2.5) = sqrt(0.4) = 0.6324555320336759.
    # (Per-prompt statistics would give +-1 here.)
    out = tr.update(["a", "a", "b", "b"], t(0, 4, 1, 3))
    close(out, [-1.2649110640673518, 1.2649110640673518, -0.6324555320336759, 0.6324555320336759])
    assert tr.stats()["batch_fallback_frac"] == 1.0
    # Update 2: a's history [0, 4, 2, 6] has 4 >= 3: mean 3, dev [-3, 1, -1, 3], pop var 20/4 = 5;
    # -1/sqrt(5) = -0.4472135954999579, 3/sqrt(5) = 1.3416407864998738.
    out = tr.update(["a", "a"], t(2, 6))
    close(out, [-0.4472135954999579, 1.3416407864998738])
    st = tr.stats()
    assert st["num_prompts"] == 2 and st["ready_frac"] == 0.5 and st["batch_fallback_frac"] == 0.0
    assert st["history_len_max"] == 4 and st["history_len_min"] == 2

    state = json.loads(json.dumps(tr.state_dict()))
    tr2 = PerPromptStatTracker(buffer_size=4, min_count=3, eps=0.0, clip=None)
    tr2.load_state_dict(state)
    assert tr2.state_dict() == tr.state_dict()
    # Update 3: the deque drops the oldest reward: a = [4, 2, 6, 10], mean 5.5,
    # dev [-1.5, -3.5, 0.5, 4.5], pop var (2.25 + 12.25 + 0.25 + 20.25)/4 = 8.75, std 2.958039891549808;
    # A = 4.5 / 2.958039891549808 = 1.52127765851133.
    for tracker in (tr, tr2):
        close(tracker.update(["a"], t(10.0)), [1.52127765851133])
    assert tr.state_dict() == tr2.state_dict() and tr.state_dict()["history"]["a"] == [4.0, 2.0, 6.0, 10.0]

    tr.clear()
    assert tr.stats()["num_prompts"] == 0


def test_stat_tracker_clip_eps_and_errors():
    tr = PerPromptStatTracker(buffer_size=8, min_count=2)  # default eps 1e-4, clip 5
    # a: [1, 3] reaches min_count: mean 2, std 1 -> +-1/1.0001; float32 in, float32 out
    out = tr.update(["a", "a"], torch.tensor([1.0, 3.0]))
    assert out.dtype == torch.float32
    close(out, [-0.9999000099990001, 0.9999000099990001], atol=1e-6)
    # a constant prompt history gives exactly 0
    assert torch.equal(tr.update(["c", "c"], torch.tensor([0.1, 0.1])), torch.zeros(2))
    with pytest.raises(ValueError, match="prompts.*3 prompts for 2 rewards"):
        tr.update(["a", "b", "c"], torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="min_count"):
        PerPromptStatTracker(buffer_size=4, min_count=5)


# ---------------------------------------------------------------------------- combine_rewards

# Groups [0, 0, 0, 1, 1, 1]; a = [1, 2, 3, 5, 5, 5], b = [0, 0, 6, 2, 4, 0]; weights a: 2, b: 1.
CR = {"a": t(1, 2, 3, 5, 5, 5), "b": t(0, 0, 6, 2, 4, 0)}
CW = {"a": 2.0, "b": 1.0}
CG = torch.tensor([0, 0, 0, 1, 1, 1])


def test_combine_rewards_reward_sum():
    # total = [2, 4, 12, 12, 14, 10].
    # group 0 [2, 4, 12]: mean 6, dev [-4, -2, 6], pop var 56/3, std 4.320493798938574
    #   -> [-0.9258200997725514, -0.4629100498862757, 1.3887301496588271]
    # group 1 [12, 14, 10]: mean 12, dev [0, 2, -2], pop var 8/3, std 1.632993161855452
    #   -> [0, 1.224744871391589, -1.224744871391589]
    out = combine_rewards(CR, CW, CG, mode="reward_sum", eps=0.0, clip=None)
    close(out, [-0.9258200997725514, -0.4629100498862757, 1.3887301496588271, 0.0, 1.224744871391589,
                -1.224744871391589])


def test_combine_rewards_advantage_sum():
    # a, group 0 [1, 2, 3]: std sqrt(2/3) -> [-1.224744871391589, 0, 1.224744871391589]; group 1 constant -> 0
    # b, group 0 [0, 0, 6]: mean 2, dev [-2, -2, 4], pop var 8, std 2.8284271247461903
    #   -> [-0.7071067811865475, -0.7071067811865475, 1.414213562373095]
    # b, group 1 [2, 4, 0]: -> [0, 1.224744871391589, -1.224744871391589]
    # 2 a + b: [-3.1565965239697256, -0.7071067811865475, 3.863703305156273, 0, 1.2247..., -1.2247...]
    expected = [-3.1565965239697256, -0.7071067811865475, 3.863703305156273, 0.0, 1.224744871391589,
                -1.224744871391589]
    close(combine_rewards(CR, CW, CG, mode="advantage_sum", eps=0.0, clip=None), expected)
    # the clip applies to the sum only (per-reward advantages here are all within 3)
    clipped = [-3.0, -0.7071067811865475, 3.0, 0.0, 1.224744871391589, -1.224744871391589]
    close(combine_rewards(CR, CW, CG, mode="advantage_sum", eps=0.0, clip=3.0), clipped)


def test_combine_rewards_errors():
    with pytest.raises(ValueError, match="weights has no entry.*'b'"):
        combine_rewards(CR, {"a": 1.0}, CG)
    with pytest.raises(ValueError, match="unknown reward.*'c'"):
        combine_rewards(CR, {**CW, "c": 1.0}, CG)
    with pytest.raises(ValueError, match="mode.*'reward_sum'.*received 'sum'"):
        combine_rewards(CR, CW, CG, mode="sum")
    with pytest.raises(ValueError, match="same shape"):
        combine_rewards({"a": t(1, 2), "b": t(1, 2, 3)}, {"a": 1, "b": 1}, [0, 0])


# ---------------------------------------------------------------------------- GAE


def test_gae_hand_example_with_masked_middle():
    # gamma = lam = 0.5, so gamma * lam = 0.25.
    # Row 0: mask [1, 0, 1, 1], r = [0, 100, 0, 1] (100 sits on a masked position: ignored),
    #        V = [0.5, 9, 0.25, 0.5 | bootstrap 2].
    #   t=3: delta = 1 + 0.5*2 - 0.5 = 1.5;            A3 = 1.5
    #   t=2: delta = 0 + 0.5*0.5 - 0.25 = 0;           A2 = 0 + 0.25*1.5 = 0.375
    #   t=1: masked -> 0, skipped
    #   t=0: V_next = V2 = 0.25 (not V1 = 9): delta = 0 + 0.125 - 0.5 = -0.375;  A0 = -0.375 + 0.25*0.375 = -0.28125
    #   returns = A + V = [0.21875, 0, 0.625, 2.0]
    # Row 1: mask [1, 1, 0, 0], r = [1, 1, 5, 5], V = [1, 1, 7, 7 | 3]; the last unmasked step bootstraps V_T = 3.
    #   t=1: delta = 1 + 1.5 - 1 = 1.5;  A1 = 1.5
    #   t=0: delta = 1 + 0.5 - 1 = 0.5;  A0 = 0.5 + 0.25*1.5 = 0.875;  returns [1.875, 2.5, 0, 0]
    r = t(0, 100, 0, 1, 1, 1, 5, 5).reshape(2, 4)
    v = t(0.5, 9, 0.25, 0.5, 2, 1, 1, 7, 7, 3).reshape(2, 5)
    m = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    adv, ret = gae(r, v, m, gamma=0.5, lam=0.5)
    close(adv, [[-0.28125, 0.0, 0.375, 1.5], [0.875, 1.5, 0.0, 0.0]])
    close(ret, [[0.21875, 0.0, 0.625, 2.0], [1.875, 2.5, 0.0, 0.0]])
    # values [B, T]: V_T = 0. Row 0: t=3 delta = 1 - 0.5 = 0.5; t=2: A2 = 0 + 0.25*0.5 = 0.125;
    #   t=0: A0 = -0.375 + 0.25*0.125 = -0.34375; returns [0.15625, 0, 0.375, 1.0]
    adv, ret = gae(r[:1], v[:1, :4], m[:1].float(), gamma=0.5, lam=0.5)
    close(adv, [[-0.34375, 0.0, 0.125, 0.5]])
    close(ret, [[0.15625, 0.0, 0.375, 1.0]])


def test_gae_monte_carlo_limit_and_errors():
    # gamma = lam = 1 telescopes to A_t = sum_{k >= t} r_k + V_T - V_t.
    gen = torch.Generator().manual_seed(2)
    r, v = torch.randn(3, 5, generator=gen, dtype=D), torch.randn(3, 6, generator=gen, dtype=D)
    adv, _ = gae(r, v, None, gamma=1.0, lam=1.0)
    expected = r.flip(1).cumsum(1).flip(1) + v[:, 5:] - v[:, :5]
    close(adv, expected, atol=1e-12)
    with pytest.raises(ValueError, match="values must have shape.*\\[3, 5\\].*\\(3, 7\\)"):
        gae(r, torch.zeros(3, 7), None, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="lam"):
        gae(r, v, None, gamma=1.0, lam=1.5)
