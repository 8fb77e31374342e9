"""Sampler: greedy is argmax, top-k/top-p masks, seeded draws independent of the batch."""

import torch

from vlmbatch.engine.sampler import SamplingBatch, apply_top_k_top_p, sample
from vlmbatch.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def draw(logits, params, positions=None):
    positions = positions or [0] * len(params)
    return sample(logits, SamplingBatch.build(params, positions, CPU)).tolist()


def test_greedy_is_argmax_also_in_mixed_batch():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(temperature=0)]
    tokens = draw(logits, params)
    expected = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]


def test_top_k_keeps_k_best_and_top_p_keeps_nucleus():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [4.0, 3.0, 2.0, 1.0, 0.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.7]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False, False]
    # softmax of [4,3,2,1,0]: 0.636, 0.234, ... -> the first two tokens reach 0.7
    assert torch.isfinite(masked[1]).tolist() == [True, True, False, False, False]
    assert torch.equal(masked[0, :2], logits[0, :2])


def test_top_k_one_is_greedy_and_samples_stay_in_top_k():
    logits = torch.randn(64, 100)
    assert draw(logits, [SamplingParams(temperature=1.0, top_k=1)] * 64) == logits.argmax(-1).tolist()
    top3 = logits.topk(3, dim=-1).indices
    tokens = torch.tensor(draw(logits, [SamplingParams(temperature=2.0, top_k=3)] * 64))
    assert (top3 == tokens.unsqueeze(-1)).any(-1).all()


def test_seeded_rows_do_not_depend_on_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(3, 1000)
    seeded = SamplingParams(temperature=1.0, seed=123)
    alone = draw(logits[1:2], [seeded], positions=[5])
    in_batch = draw(logits, [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.5, seed=9)], positions=[0, 5, 1])
    assert in_batch[1] == alone[0]
    later_step = [draw(logits[1:2], [seeded], positions=[p])[0] for p in range(6, 16)]
    assert len(set(later_step)) > 1  # the noise moves on with the output position


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(4000, 3)
    counts = torch.bincount(torch.tensor(draw(logits, [SamplingParams(temperature=1.0)] * 4000)), minlength=3)
    assert torch.allclose(counts / 4000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
