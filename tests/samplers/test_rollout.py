"""Rollout, windows, per-sample noise and batched ODE completion."""

import pytest
import torch

from samplers import (
    Window,
    derive_seed,
    initial_noise,
    make_sample_seeds,
    make_step,
    ode_complete,
    rollout,
    shifted_sigmas,
    step_noise,
    steps_noise,
    train_mask,
    window_start,
)

T = 10
SHAPE = (2, 4, 4)


def _sigmas():
    return shifted_sigmas(T, 3.0)


# --- windows ---------------------------------------------------------------------------------------------


def test_fixed_window_and_defaults():
    assert train_mask(None, T).tolist() == [True] * 9 + [False]  # last step never trained
    assert train_mask(None, T, deterministic_last_step=False).tolist() == [True] * 10
    assert torch.nonzero(train_mask(Window("fixed", start=2, size=3), T)).flatten().tolist() == [2, 3, 4]
    assert torch.nonzero(train_mask(Window(start=6), T)).flatten().tolist() == [6, 7, 8]
    assert torch.nonzero(train_mask({"mode": "fixed", "start": 0, "size": 2}, T)).flatten().tolist() == [0, 1]
    with pytest.raises(ValueError, match="does not fit"):
        train_mask(Window("fixed", start=8, size=2), T)  # would cover the deterministic last step
    assert train_mask(Window("fixed", start=8, size=2), T, deterministic_last_step=False)[8:].all()
    with pytest.raises(ValueError, match="mode"):
        Window("growing")
    with pytest.raises(ValueError, match="size"):
        Window("random")


def test_random_window_is_reproducible_and_in_range():
    w = Window("random", start=1, size=2, max_start=5)
    starts = [window_start(w, T, iteration=i, seed=7) for i in range(200)]
    assert starts == [window_start(w, T, i, 7) for i in range(200)]  # pure in (seed, iteration)
    assert set(starts) == {1, 2, 3, 4, 5}  # uniform over {start..max_start}: every start shows up
    assert starts != [window_start(w, T, iteration=i, seed=8) for i in range(200)]
    for i in range(20):
        mask = train_mask(w, T, iteration=i, seed=7)
        s = starts[i]
        assert torch.nonzero(mask).flatten().tolist() == [s, s + 1]
    # default max_start: the last start that fits the 9 trainable steps
    assert max(window_start(Window("random", size=3), T, iteration=i) for i in range(300)) == 6


def test_sliding_window_advances_every_k_and_wraps():
    w = Window("sliding", size=4, every=2)  # 9 trainable steps -> starts 0..5
    starts = [window_start(w, T, iteration=i) for i in range(16)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 0, 0, 1, 1]
    w2 = Window("sliding", start=2, size=1, max_start=3)
    assert [window_start(w2, T, iteration=i) for i in range(5)] == [2, 3, 2, 3, 2]
    assert torch.nonzero(train_mask(w, T, iteration=5)).flatten().tolist() == [2, 3, 4, 5]


def test_rollout_trains_exactly_the_window(gaussian_flow):
    x = initial_noise(SHAPE, make_sample_seeds(0, 0, range(4)))
    w = Window("fixed", start=3, size=2)
    traj = rollout(gaussian_flow, x, _sigmas(), step="flow_sde", window=w,
                   sample_seeds=make_sample_seeds(1, 0, range(4)))
    assert traj.train_mask.tolist() == [False] * 3 + [True] * 2 + [False] * 5
    assert traj.trained_steps == [3, 4] and traj.window_start == 3
    assert (traj.stds[:, 3:5] > 0).all() and (traj.stds[:, :3] == 0).all() and (traj.stds[:, 5:] == 0).all()
    assert (traj.log_probs[:, :3] == 0).all() and (traj.log_probs[:, 5:] == 0).all()
    assert (traj.noise_scales[3:5] > 0).all() and (traj.noise_scales[[0, 1, 2, 5, 6, 7, 8, 9]] == 0).all()
    # steps outside the window are exactly the Euler steps
    ode = rollout(gaussian_flow, x, _sigmas(), step="ode")
    assert torch.equal(traj.latents[:, :4], ode.latents[:, :4])
    assert not ode.train_mask.any() and (ode.log_probs == 0).all()


# --- trajectories and re-scoring ---------------------------------------------------------------------------


def test_trajectory_fields_and_shapes(gaussian_flow):
    B = 3
    seeds = make_sample_seeds(5, 2, range(B))
    x = initial_noise(SHAPE, seeds).to(torch.bfloat16)
    calls = []

    def vel(x_, s_, c_):
        calls.append((x_.dtype, s_.dtype, tuple(s_.shape)))
        return gaussian_flow(x_.float(), s_).to(torch.bfloat16)

    traj = rollout(vel, x, _sigmas(), step="cps", step_kwargs={"noise_level": 0.5}, sample_seeds=seeds,
                   store_x0=True, store_means=True)
    assert traj.latents.shape == (B, T + 1) + SHAPE and traj.latents.dtype == torch.float32
    assert traj.log_probs.shape == (B, T) and traj.stds.shape == (B, T)
    assert traj.means.shape == (B, T) + SHAPE and traj.x0_preds.shape == (B, T) + SHAPE
    assert traj.sigmas.shape == (T + 1,) and traj.train_mask.shape == (T,) and traj.noise_scales.shape == (T,)
    assert traj.nfe == B * T and len(calls) == T and traj.model_dtype == torch.bfloat16
    assert all(c == (torch.bfloat16, torch.float32, (B,)) for c in calls)  # model dtype in, per-row sigma
    assert torch.equal(traj.latents[:, 0], x.float())
    assert traj.step.name == "cps" and traj.step.hyperparams["noise_level"] == 0.5
    # x0_preds = x - sigma v at each step; the last step lands on its own prediction
    for t in (0, 5, 9):
        v = vel(traj.latents[:, t].to(torch.bfloat16), traj.sigmas[t].expand(B), None).float()
        assert torch.equal(traj.x0_preds[:, t], traj.latents[:, t] - traj.sigmas[t] * v)
    assert torch.allclose(traj.x0_preds[:, -1], traj.x0, atol=1e-6)
    sub = traj.select([2, 0])
    assert torch.equal(sub.latents, traj.latents[[2, 0]]) and torch.equal(sub.sample_seeds, seeds[[2, 0]])


@pytest.mark.parametrize("step_name", ["flow_sde", "dance_sde", "cps", "ddim"])
def test_training_pass_rescoring_is_bitwise(gaussian_flow, step_name):
    B = 4
    seeds = make_sample_seeds(3, 1, range(B))
    x = initial_noise(SHAPE, seeds)
    seen = []

    def vel(x_, s_, c_):
        seen.append(x_.clone())
        return gaussian_flow(x_, s_)

    traj = rollout(vel, x, _sigmas(), step=step_name, sample_seeds=seeds)
    for t in traj.trained_steps:
        assert torch.equal(traj.state(t), seen[t]) and traj.state(t).is_contiguous()
        v = gaussian_flow(traj.state(t).to(traj.model_dtype), traj.sigmas[t].expand(B))
        out = traj.score_step(v, t)
        assert torch.equal(out.log_prob, traj.log_probs[:, t])
        ratio = torch.exp(out.log_prob - traj.log_probs[:, t])
        assert torch.equal(ratio, torch.ones(B))
        # a minibatch of rows, scored with a per-row index tensor, gives the same bits
        rows = torch.tensor([2, 1])
        sub = traj.step(v[rows], traj.state(t, rows), torch.full((2,), t), x_next=traj.state(t + 1, rows))
        assert torch.equal(sub.log_prob, traj.log_probs[rows, t])
        assert torch.equal(traj.score_step(v[rows], t, rows).log_prob, traj.log_probs[rows, t])


# --- per-sample determinism ------------------------------------------------------------------------------------


def test_initial_and_step_noise_are_per_sample():
    seeds = make_sample_seeds(0, 3, range(8))
    assert seeds.dtype == torch.int64 and len(set(seeds.tolist())) == 8
    full = initial_noise(SHAPE, seeds)
    assert full.shape == (8,) + SHAPE
    for b in (0, 5):
        assert torch.equal(initial_noise(SHAPE, seeds[b : b + 1])[0], full[b])
        assert torch.equal(step_noise(SHAPE, seeds[b : b + 1], 4)[0], step_noise(SHAPE, seeds, 4)[b])
    assert not torch.equal(step_noise(SHAPE, seeds, 4), step_noise(SHAPE, seeds, 5))
    assert not torch.equal(step_noise(SHAPE, seeds, 0), full)  # different streams
    # seeds depend on (seed, epoch, global index) only
    assert torch.equal(make_sample_seeds(0, 3, [5]), seeds[5:6])
    assert derive_seed(1, 2) != derive_seed(2, 1) and 0 <= derive_seed(-1, 2**70) < 2**63
    big = initial_noise((4000,), make_sample_seeds(1, 0, range(4)))
    assert abs(big.mean().item()) < 0.05 and abs(big.std().item() - 1) < 0.05


def test_the_noise_of_several_steps_drawn_at_once_is_each_steps_noise():
    """A rollout draws its SDE steps' noise before the first step (one copy to the device instead of one per step):
    bit for bit the noise it drew step by step."""
    seeds = make_sample_seeds(0, 3, range(5))
    several = steps_noise(SHAPE, seeds, [1, 4, 2])
    assert several.shape == (3, 5) + SHAPE
    for k, t in enumerate([1, 4, 2]):
        assert torch.equal(several[k], step_noise(SHAPE, seeds, t))
    assert steps_noise(SHAPE, seeds, []).shape == (0, 5) + SHAPE


@pytest.mark.parametrize("step_name", ["flow_sde", "cps"])
def test_sample_trajectory_independent_of_batch(gaussian_flow, step_name):
    seeds = make_sample_seeds(11, 4, range(100, 108))  # global indices 100..107
    x = initial_noise(SHAPE, seeds)
    kw = dict(step=step_name, window=Window("random", size=3), iteration=4, seed=11, store_x0=True)
    batch = rollout(gaussian_flow, x, _sigmas(), sample_seeds=seeds, **kw)
    for b in (0, 3, 7):
        alone = rollout(gaussian_flow, initial_noise(SHAPE, seeds[b : b + 1]), _sigmas(),
                        sample_seeds=seeds[b : b + 1], **kw)
        assert torch.equal(alone.latents[0], batch.latents[b])
        assert torch.equal(alone.log_probs[0], batch.log_probs[b])
        assert torch.equal(alone.x0_preds[0], batch.x0_preds[b])
    # a batch in another order (another process's slice) gives the same rows
    perm = torch.tensor([7, 2, 5, 0, 1, 6, 3, 4])
    shuffled = rollout(gaussian_flow, x[perm], _sigmas(), sample_seeds=seeds[perm], **kw)
    assert torch.equal(shuffled.latents, batch.latents[perm])
    # reproducible from the seeds alone, and different seeds give different samples
    assert torch.equal(rollout(gaussian_flow, x, _sigmas(), sample_seeds=seeds, **kw).latents, batch.latents)
    other = rollout(gaussian_flow, x, _sigmas(), sample_seeds=seeds + 1, **kw)
    assert not torch.equal(other.x0, batch.x0)


def test_rollout_randomness_sources(gaussian_flow):
    x = initial_noise(SHAPE, make_sample_seeds(0, 0, range(2)))
    a = rollout(gaussian_flow, x, _sigmas(), generator=torch.Generator().manual_seed(3))
    b = rollout(gaussian_flow, x, _sigmas(), generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.latents, b.latents) and a.sample_seeds is None
    c = rollout(gaussian_flow, x, _sigmas(), seed=1, iteration=2)  # default seeds from (seed, iteration, row)
    assert torch.equal(c.sample_seeds, make_sample_seeds(1, 2, range(2)))
    with pytest.raises(ValueError, match="not both"):
        rollout(gaussian_flow, x, _sigmas(), generator=torch.Generator(), sample_seeds=c.sample_seeds)
    with pytest.raises(ValueError, match="different schedule"):
        rollout(gaussian_flow, x, _sigmas(), step=make_step("flow_sde", shifted_sigmas(T, 2.0)))


# --- ODE completion -----------------------------------------------------------------------------------------


def test_ode_complete_batches_rows_at_different_steps(gaussian_flow):
    sig = _sigmas()
    N = 6
    x = torch.randn((N,) + SHAPE, generator=torch.Generator().manual_seed(0))
    start = torch.tensor([0, 3, 9, 10, 5, 3])
    calls = []
    cond = {"emb": torch.arange(N, dtype=torch.float32)[:, None]}

    def vel(x_, s_, c_):
        calls.append(x_.shape[0])
        assert c_["emb"].shape[0] == x_.shape[0]
        return gaussian_flow(x_, s_)

    x0, nfe = ode_complete(vel, x, sig, start, cond=cond)
    remaining = (T - start).tolist()
    assert len(calls) == max(remaining)  # one batched call per round
    assert nfe == sum(remaining) == sum(calls)
    for n in range(N):
        s = int(start[n])
        # each row alone: its own Euler ODE from sigmas[s]
        solo = x[n : n + 1].clone()
        for t in range(s, T):
            solo = solo + (sig[t + 1] - sig[t]) * gaussian_flow(solo, sig[t].expand(1))
        assert torch.allclose(x0[n], solo[0], atol=1e-6)
        alone, nfe1 = ode_complete(gaussian_flow, x[n : n + 1], sig, start[n : n + 1])
        assert torch.equal(alone[0], x0[n]) and nfe1 == T - s
    assert torch.equal(x0[3], x[3])  # start = T: already at sigma = 0
    # the row from step 0 equals a full ODE rollout
    assert torch.equal(x0[0], rollout(gaussian_flow, x[:1], sig, step="ode").x0[0])
    calls.clear()
    x0b, nfe_b = ode_complete(vel, x, sig, start, cond=cond, max_batch=2)
    assert torch.equal(x0b, x0) and nfe_b == nfe and max(calls) <= 2


def test_log_probs_batch_invariant_with_threaded_reductions(gaussian_flow):
    """Large samples (D = 65536) with 2 threads: a float32 reduction over D would be split differently
    for a batch of 1 and of 8 and differ in the last bits; log-probs accumulate in float64 instead."""
    torch.set_num_threads(2)  # restored by the autouse fixture
    shape = (4, 128, 128)
    seeds = make_sample_seeds(2, 0, range(8))
    sig = shifted_sigmas(3, 3.0)
    kw = dict(step="flow_sde", step_kwargs={"reduction": "sum"})
    batch = rollout(gaussian_flow, initial_noise(shape, seeds), sig, sample_seeds=seeds, **kw)
    alone = rollout(gaussian_flow, initial_noise(shape, seeds[5:6]), sig, sample_seeds=seeds[5:6], **kw)
    assert torch.equal(alone.latents[0], batch.latents[5])
    assert torch.equal(alone.log_probs[0], batch.log_probs[5])


def test_trajectory_pickles(gaussian_flow):
    """Recipes move trajectories between processes (gather_object) and into checkpoints."""
    import io
    import pickle

    x = initial_noise(SHAPE, make_sample_seeds(0, 0, range(2)))
    traj = rollout(gaussian_flow, x, _sigmas(), step="cps", window=Window("sliding", size=2), iteration=3)
    back = pickle.loads(pickle.dumps(traj))
    assert torch.equal(back.latents, traj.latents) and back.step.name == "cps"
    buf = io.BytesIO()
    torch.save(traj, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    v = gaussian_flow(again.state(4), again.sigmas[4].expand(2))
    assert torch.equal(again.score_step(v, 4).log_prob, traj.log_probs[:, 4])


def test_trajectory_cat_equals_one_rollout_and_to_moves_per_sample_fields(gaussian_flow):
    """An epoch rolled out in two calls, concatenated, is the epoch rolled out in one call."""
    from samplers import Trajectory

    v, sig = gaussian_flow, _sigmas()
    seeds = make_sample_seeds(3, 0, range(6))
    x = initial_noise(SHAPE, seeds)
    kwargs = dict(step="flow_sde", window={"start": 1, "size": 2}, sample_seeds=None, store_x0=True)
    whole = rollout(v, x, sig, **{**kwargs, "sample_seeds": seeds})
    parts = [rollout(v, x[i:i + 3], sig, **{**kwargs, "sample_seeds": seeds[i:i + 3]}) for i in (0, 3)]
    joined = Trajectory.cat(parts)
    for name in Trajectory.PER_SAMPLE:
        a, b = getattr(joined, name), getattr(whole, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert joined.nfe == whole.nfe and torch.equal(joined.train_mask, whole.train_mask)
    moved = joined.to("meta")
    assert moved.latents.device.type == "meta" and moved.x0_preds.device.type == "meta"
    assert moved.sigmas.device.type == "cpu" and moved.train_mask.device.type == "cpu"
    other = rollout(v, x[:3], sig, **{**kwargs, "window": {"start": 0, "size": 2}, "sample_seeds": seeds[:3]})
    with pytest.raises(ValueError, match="part 1 has a different schedule or trained steps"):
        Trajectory.cat([parts[0], other])
    no_x0 = rollout(v, x[:3], sig, **{**kwargs, "store_x0": False, "sample_seeds": seeds[:3]})
    with pytest.raises(ValueError, match="part 1 lacks x0_preds"):
        Trajectory.cat([parts[0], no_x0])
    with pytest.raises(ValueError, match="at least one"):
        Trajectory.cat([])
