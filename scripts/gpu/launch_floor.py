"""What a chain of N dependent kernels costs in one CUDA graph on this GPU (issue #16).

SmolLM2's fused batch-1 decode is ~158 launches (five a layer, 30 layers, plus embedding,
visible columns, three tap copies, final norm, logits and argmax) and takes ~0.77 ms. The
2,000 tok/s bar is 0.5 ms. This prints, for several N, the replay time of a graph of N
dependent tiny kernels (the launch floor: nothing to compute, one float read and written) and
of N dependent 576x576 bf16 matrix-vector products (cuBLAS, SmolLM2's o_proj shape), so the
floor a 5-, 4- or 3-launch layer sits on is measured on the same card, not guessed.

    python3 launch_floor.py [--replays 200]
"""

import argparse
import statistics

import torch


def graph_of(n, step):
    """A CUDA graph of `n` calls of `step()` (each depends on the previous one)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            step()
    return graph


def replay_us(graph, replays):
    """Median wall time of one replay (synchronised), in microseconds."""
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    dev = torch.device("cuda")
    x = torch.zeros(1, device=dev)
    w = torch.randn(576, 576, device=dev, dtype=torch.bfloat16) / 24
    vs = [torch.randn(576, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    turn = [0]

    def tiny():
        x.add_(1.0)

    def gemv():
        # Ping-pong between two vectors: one kernel a step, each reading the previous output.
        a, b = vs[turn[0] % 2], vs[(turn[0] + 1) % 2]
        torch.mv(w, a, out=b)
        turn[0] += 1

    print(f"launch floor on {torch.cuda.get_device_name(0)} (CUDA graph replays, median of {args.replays})")
    print("| kernels in the chain | tiny kernels us | us a kernel | 576x576 gemv us | us a gemv |")
    print("|---|---|---|---|---|")
    for n in (158, 128, 98, 68, 32):
        t_tiny = replay_us(graph_of(n, tiny), args.replays)
        t_gemv = replay_us(graph_of(n, gemv), args.replays)
        print(f"| {n} | {t_tiny:.1f} | {t_tiny / n:.2f} | {t_gemv:.1f} | {t_gemv / n:.2f} |")


if __name__ == "__main__":
    main()
