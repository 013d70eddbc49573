"""RunReport's throughput counts samples, whatever shape the user's batch has."""

import torch

from lightning_sparselift.lightning.callbacks import samples_in


def test_samples_are_counted_in_any_batch_shape():
    from torchrec import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), lengths=torch.tensor([1, 2, 0, 0, 1, 1]))
    assert samples_in({"dense": torch.zeros(3, 4), "sparse": kjt, "label": torch.zeros(3)}) == 3  # not its 3 keys
    assert samples_in({"x": torch.zeros(5, 2), "y": torch.zeros(5)}) == 5
    assert samples_in((torch.zeros(6, 2), torch.zeros(6))) == 6
    assert samples_in([1, 2, 3, 4]) == 4
