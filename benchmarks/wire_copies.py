"""What each wire format costs in the output all-to-all's packing and unpacking, both directions,
on the training thread's CPU clock (one process, no exchange: what arrives is what was sent):
float32, TorchRec's FP16 and BF16 codecs in their own calls (``Wire(codecs)``), and the
communication-precision pass's BF16 cast fused into the layouts' copies (``Wire(cast=...)``).
Shapes: dlrm's (2 ranks, batch 1024 per rank, 13 tables of dim 64 on this rank), as one group
(dlrm's: the consumer layout reads the buffer raw, nothing else copies) and as two merged groups
(aggregation's packing copies).

    python benchmarks/wire_copies.py [--rounds 9 --reps 30]

Timed: run it alone. The wires are timed in turn, round after round; each cell is the median of
the rounds (other sessions' processes share these cores).
"""

import argparse
import statistics
import time

import torch

from lightning_sparselift.runtime.buffers import Buffers
from lightning_sparselift.runtime.layout import ExchangeBuffers, PooledLayout, Wire


def _codecs(forward: str, backward: str):
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    config = QCommsConfig(forward_precision=CommType[forward], backward_precision=CommType[backward])
    return get_qcomm_codecs_registry(config)["POOLED_EMBEDDINGS_ALL_TO_ALL"]  # (as on CUDA: BF16 kept)


WIRES = {"float32": lambda: Wire(), "TorchRec FP16 codec": lambda: Wire(_codecs("FP16", "FP16")),
         "TorchRec BF16 codec": lambda: Wire(_codecs("BF16", "BF16")),
         "BF16 cast (fused)": lambda: Wire(cast={True: torch.bfloat16, False: torch.bfloat16})}


def step_ms(dims: list[list[int]], raw: bool, wire: Wire, reps: int) -> float:
    """Training-thread CPU ms of one step's pack and unpack, forward and backward."""
    world, b = 2, 1024
    buffers = Buffers()
    locals_ = tuple(torch.randn(world * b, d[0]) for d in dims)
    grads = None

    def one() -> None:
        nonlocal grads
        layout = PooledLayout(dims, b, None, [None] * len(dims), 0, ExchangeBuffers.of(buffers, [0]), raw=raw,
                              wire=wire.for_step())
        send, _, _ = layout.send_outputs(locals_)
        outputs = layout.unpack_outputs(send)
        grads = grads or tuple(torch.randn_like(o) for o in outputs)
        g_send, _, _ = layout.send_grads(grads)
        layout.unpack_grads(g_send)

    for _ in range(3):
        one()
    start = time.thread_time()
    for _ in range(reps):
        one()
    return (time.thread_time() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--reps", type=int, default=30, help="steps per round and wire")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = {"one group, consumer layout (raw)": ([[832, 832]], True),
             "one group, unpacked per group": ([[832, 832]], False),
             "two groups merged (aggregation)": ([[448, 448], [384, 384]], False)}
    print(f"| layout | {' | '.join(WIRES)} |")
    print("|---|" + "---|" * len(WIRES))
    for name, (dims, raw) in cases.items():
        rounds = [[step_ms(dims, raw, make(), args.reps) for make in WIRES.values()] for _ in range(args.rounds)]
        row = [f"{statistics.median(cell):.2f}" for cell in zip(*rounds)]
        print(f"| {name} | {' | '.join(row)} |")
    print(f"\nms of training-thread CPU per step (pack + unpack, forward and backward), median of {args.rounds} "
          f"rounds of {args.reps} steps, torch {torch.__version__}, 1 thread")


if __name__ == "__main__":
    main()
