"""The training objective with multi-token prediction (`titan_trainer.loss`): DeepSeek-V3's
loss_main + weight / D x (loss_1 + ... + loss_D), each depth scored on the labels it
predicts, the positions past the sample left out; on a real DeepSeek-V3 model's outputs."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from titan_trainer.loss import cross_entropy_loss, labels_ahead, with_mtp


def test_labels_ahead_move_left_and_leave_out_the_end():
    labels = torch.tensor([[1, 2, 3, 4]])
    assert labels_ahead(labels, 1).tolist() == [[2, 3, 4, -100]]
    assert labels_ahead(labels, 2).tolist() == [[3, 4, -100, -100]]


def test_loss_is_the_main_loss_plus_the_weighted_mean_of_the_depths():
    from titan_models.deepseek_v3 import DeepSeekV3Transformer, deepseek_v3_flavors

    base = deepseek_v3_flavors["debugmodel"]
    args = dataclasses.replace(
        base, dim=32, n_layers=2, n_heads=2, vocab_size=64, q_lora_rank=0, kv_lora_rank=8,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_seq_len=8, moe=None,
        hidden_dim=48, n_mtp_layers=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = DeepSeekV3Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    window = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    inputs, labels = window[:, :-1], window[:, 1:]
    outputs = model.train()(inputs)
    assert len(outputs) == 3
    # Written out: depth k at position i predicts window[i + k + 1], for i + k + 1 <= 8.
    depths = []
    for k in (1, 2):
        logits = outputs[k][:, : 8 - k]
        depths.append(F.cross_entropy(logits.flatten(0, 1), window[:, k + 1 :].flatten()))
    main = F.cross_entropy(outputs[0].flatten(0, 1), labels.flatten())
    expected = main + 0.3 / 2 * (depths[0] + depths[1])
    got = with_mtp(cross_entropy_loss, 0.3)(outputs, labels)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    # A plain tensor of logits (evaluation, a model without MTP) is the plain loss.
    assert torch.equal(with_mtp(cross_entropy_loss, 0.3)(outputs[0], labels), main)
    # The weight scales the depths' gradient: 0 leaves the MTP layers without one.
    with_mtp(cross_entropy_loss, 0.0)(outputs, labels).backward()
    assert model.layers["2"].eh_proj.weight.grad.abs().max() == 0
    assert model.layers["1"].attention.wo.weight.grad.abs().max() > 0
