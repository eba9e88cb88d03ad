"""Does an NCCL send overlap a prefill's kernels? The layer-wise stream, without the engine.

    python benchmarks/gpu_overlap.py            # 2 GPUs: sender on GPU 0, receiver on GPU 1

GPU 0 runs 32 "layers" of Llama-3-8B-shape prefill work for an 8000-token chunk on its compute
stream; after each layer a 31 MiB message (that layer's K and V, bf16) is sent to GPU 1 on a
highest-priority stream that waits for the layer (a CUDA event, no host sync), exactly as the
prefill worker's stream does. Loads: ``gemm`` (the layer's four projections), ``attention``
(causal SDPA over the chunk), ``layer`` (both). For each load and cuBLAS SM carveout it reports
the compute time per layer alone and with the sends, and each send's time from its layer's end
(the receiver has posted every receive in advance) and bandwidth, against the same message sent
with the GPU idle. Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 8000, 4096, 32, 8, 128, 14336, 32
MESSAGE = 2 * KV_HEADS * TOKENS * HEAD_DIM * 2


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--carveouts", type=int, nargs="+", default=[0, 8, 16, 32])
    ap.add_argument("--loads", nargs="+", default=["gemm", "attention", "layer"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_overlap.json"))
    args = ap.parse_args()

    import ray

    ray.init(include_dashboard=False, runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0"}})

    @ray.remote(num_gpus=1)
    class Peer:
        def uid(self):
            from cupy.cuda import nccl

            return nccl.get_unique_id()

        def init(self, uid, rank):
            import torch
            from cupy.cuda import nccl

            self.nccl = nccl
            self.comm = nccl.NcclCommunicator(2, uid, rank)
            self.buf = torch.empty(MESSAGE, dtype=torch.uint8, device="cuda")
            _, high = torch.cuda.Stream.priority_range()
            self.stream = torch.cuda.Stream(priority=high)

        def _p2p(self, rank):
            if rank == 0:
                self.comm.send(
                    self.buf.data_ptr(), MESSAGE, self.nccl.NCCL_UINT8, 1, self.stream.cuda_stream
                )
            else:
                self.comm.recv(
                    self.buf.data_ptr(), MESSAGE, self.nccl.NCCL_UINT8, 0, self.stream.cuda_stream
                )

        def receive(self, n):
            """``n`` receives, posted at once (the receiver is never the late side)."""
            import torch

            with torch.cuda.stream(self.stream):
                for _ in range(n):
                    self._p2p(1)
            torch.cuda.synchronize()

        def compute(self, load, carveout, send, rounds=3):
            """Best of ``rounds``: ms per layer of ``load`` with ``carveout`` SMs left to other
            streams, sending one message per layer when ``send``; and the ms from each layer's
            end to its message's send completing (the last round's)."""
            import torch
            import torch.nn.functional as F

            torch._C._set_sm_carveout_experimental(carveout or None)
            dev, dt = torch.device("cuda"), torch.bfloat16
            x = torch.randn(TOKENS, HIDDEN, device=dev, dtype=dt)
            w = {
                "qkv": torch.randn(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN, device=dev, dtype=dt),
                "o": torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dt),
                "up": torch.randn(2 * FFN, HIDDEN, device=dev, dtype=dt),
                "down": torch.randn(HIDDEN, FFN, device=dev, dtype=dt),
            }
            q = torch.randn(1, HEADS, TOKENS, HEAD_DIM, device=dev, dtype=dt)
            kv = torch.randn(1, HEADS, TOKENS, HEAD_DIM, device=dev, dtype=dt)
            if load in ("triton", "triton-layer"):  # the engine's own prefill attention kernel
                from kernels.extend_attention import extend_attention

                block = 16
                tq = torch.randn(TOKENS, HEADS, HEAD_DIM, device=dev, dtype=dt)
                tk = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
                cache = torch.zeros(KV_HEADS, TOKENS, HEAD_DIM, device=dev, dtype=dt)
                tables = torch.arange(TOKENS // block, device=dev, dtype=torch.int32)[None]
                cu = torch.tensor([0, TOKENS], device=dev, dtype=torch.int32)
                prefix = torch.zeros(1, device=dev, dtype=torch.int32)

            def layer():
                if load in ("attention", "layer"):
                    F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
                if load in ("triton", "triton-layer"):
                    extend_attention(tq, tk, tk, cache, cache, tables, cu, prefix, TOKENS, block,
                                     HEAD_DIM**-0.5)  # fmt: skip
                if load in ("gemm", "layer", "triton-layer"):
                    x @ w["qkv"].T
                    x @ w["o"].T
                    h = x @ w["up"].T
                    h[:, :FFN] @ w["down"].T

            best, sends = float("inf"), []
            for _ in range(rounds + 1):  # the first warms up
                torch.cuda.synchronize()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                events = []
                for _ in range(LAYERS):
                    layer()
                    if send:
                        done = torch.cuda.Event()
                        done.record()
                        self.stream.wait_event(done)
                        posted, sent = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                        posted.record(self.stream)  # runs as soon as the layer is done
                        self._p2p(0)
                        sent.record(self.stream)
                        events.append((posted, sent))
                end.record()
                torch.cuda.current_stream().wait_stream(self.stream)
                torch.cuda.synchronize()
                best = min(best, start.elapsed_time(end) / LAYERS)
                sends = [p.elapsed_time(q) for p, q in events]
            torch._C._set_sm_carveout_experimental(None)
            return best, sends

    a, b = Peer.remote(), Peer.remote()
    uid = ray.get(a.uid.remote())
    ray.get([a.init.remote(uid, 0), b.init.remote(uid, 1)])

    # idle GPU: LAYERS back-to-back messages, warm-up first
    (_, idle), _ = ray.get([a.compute.remote("none", 0, True), b.receive.remote(4 * LAYERS)])
    idle_ms = statistics.median(idle)
    log(
        f"idle: {MESSAGE / 2**20:.0f} MiB send {idle_ms:.3f} ms ({MESSAGE / idle_ms / 1e6:.0f} GB/s)"
    )
    rows = []
    for load in args.loads:
        for carveout in args.carveouts:
            alone, _ = ray.get(a.compute.remote(load, carveout, False))
            (with_send, sends), _ = ray.get(
                [a.compute.remote(load, carveout, True), b.receive.remote(4 * LAYERS)]
            )
            send_ms = statistics.median(sends)
            row = {
                "load": load,
                "carveout": carveout,
                "layer_ms": alone,
                "layer_ms_with_send": with_send,
                "send_ms_median": send_ms,
                "send_gbps": MESSAGE / send_ms / 1e6,
                "idle_over_send": idle_ms / send_ms,
            }
            rows.append(row)
            log(str(row))
    report = {"message_bytes": MESSAGE, "idle_send_ms": idle_ms, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nidle send of {MESSAGE / 2**20:.0f} MiB: {idle_ms:.3f} ms")
    print("| load | carveout | layer ms | layer ms with send | send ms | send GB/s | idle / send |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['load']} | {r['carveout']} | {r['layer_ms']:.3f} | {r['layer_ms_with_send']:.3f}"
            f" | {r['send_ms_median']:.3f} | {r['send_gbps']:.0f} | {r['idle_over_send']:.3f} |"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
