"""The runtime's kept buffers: memory is handed out again only when nothing else holds it."""

from __future__ import annotations

import torch

from lightning_sparselift.runtime.buffers import Buffer, Buffers

CPU = torch.device("cpu")


def test_a_buffer_nothing_holds_gets_the_same_memory_again():
    buffer = Buffer()
    first = buffer.empty((4, 8), torch.float32, CPU)
    address = first.data_ptr()
    del first
    again = buffer.empty((4, 8), torch.float32, CPU)
    assert again.data_ptr() == address and buffer.reused == 1
    assert again.shape == (4, 8) and again.is_contiguous() and again._base is None
    # a smaller request reuses it too, in another dtype; a larger one gets new memory
    del again
    assert buffer.empty((2, 8), torch.int64, CPU).data_ptr() == address  # (the same bytes)
    assert buffer.empty((64, 8), torch.float32, CPU).data_ptr() != address


def test_memory_something_still_holds_is_never_handed_out_again():
    buffer = Buffer()
    kept = buffer.empty((16,), torch.float32, CPU).fill_(1.0)
    view = kept[4:]
    del kept
    other = buffer.empty((16,), torch.float32, CPU).fill_(2.0)  # the view still holds the first one
    assert torch.equal(view, torch.ones(12)) and buffer.reused == 0
    # an autograd node that saved it holds it too
    saved = other
    weight = torch.ones(16, requires_grad=True)
    loss = (saved * weight).sum()
    del saved, other
    third = buffer.empty((16,), torch.float32, CPU).fill_(3.0)
    loss.backward()
    assert torch.equal(weight.grad, torch.full((16,), 2.0)) and buffer.reused == 0
    del third
    assert buffer.empty((16,), torch.float32, CPU) is not None and buffer.reused == 1


def test_without_reuse_or_off_cpu_every_call_is_a_fresh_tensor():
    buffer = Buffer(reuse=False)
    for _ in range(3):
        assert buffer.empty((1024,), torch.float32, CPU).shape == (1024,)
    assert buffer.reused == 0
    meta = Buffer().empty((2, 3), torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and meta.shape == (2, 3)


def test_a_site_keeps_a_second_block_for_when_the_first_is_still_held():
    buffer = Buffer()
    held = buffer.empty((256,), torch.float32, CPU)  # e.g. the ids the current step saved for backward
    second = buffer.empty((256,), torch.float32, CPU).data_ptr()
    addresses = set()
    for _ in range(3):  # the first stays held: the second block serves every later call
        addresses.add(buffer.empty((256,), torch.float32, CPU).data_ptr())
    assert addresses == {second} and buffer.reused == 3 and held.data_ptr() != second


def test_a_modules_buffers_are_one_per_site_and_count_what_they_reused():
    buffers = Buffers()
    assert buffers.at(("received", (0, 1))) is buffers.at(("received", (0, 1)))
    assert buffers.at(("received", (0,))) is not buffers.at(("received", (0, 1)))
    for _ in range(3):
        buffers.at("x").empty((8,), torch.float32, CPU)
    assert buffers.reused == 2
    assert not Buffers(reuse=False).at("x").reuse
