"""Our trainer-side NCCL weight push into vLLM's own NCCL receiving engine, on two GPUs.

Trainer (this process, or `torchrun --nproc_per_node N`): a Qwen3-0.6B-shaped random bf16 model
on GPU 0..N-1, sharded with FSDP2, pushed through the real `WeightPusher` (FSDP2 gather, then
`NcclWeightSync`, which drives vLLM 0.32's `NCCLTrainerWeightTransferEngine` and its
`HTTPVLLMWeightSyncClient`).

Receiver (a subprocess on GPU N): vLLM's `NCCLWeightTransferEngine`, made by vLLM's
`WeightTransferEngineFactory`, behind a small HTTP server that answers vLLM's RL routes the way
`vllm serve` does (init / start / update / finish / shutdown, weight version, prefix-cache
reset, world size). What is not vLLM: the model. A full server loads the weights into its
model with layerwise reload (`start_weight_update` / `finish_weight_update`); here the engine's
`load_weights` target is a recorder that copies every received tensor into its own buffers, and
start/finish are no-ops. Everything on the wire (rendezvous through `StatelessProcessGroup`,
`PyNcclCommunicator`, the packed double-buffered broadcast) is vLLM's code.

Each round alternates: a push of new weights (version v), a check that the receiver's tensors
equal the trainer's bit for bit (sha256 of the bytes), and a plain NCCL broadcast of the same
number of bytes over the same communicator (the baseline). The last line is JSON:
`bandwidth_fraction` = baseline time / push transfer time (target >= 0.8), `stall_s` is what
`WeightPusher.push` blocks the trainer for (gather + push + version + cache reset).

GPU box (no vLLM installed): build the carry here with `bench/build_vllm_carry.py`, then
    PYTHONPATH=.vllm_carry/src:.vllm_carry/deps:core python3 bench/nccl_two_gpu.py
    PYTHONPATH=... torchrun --nproc_per_node 2 bench/nccl_two_gpu.py   # 3+ GPUs
    PYTHONPATH=... python3 bench/nccl_two_gpu.py --same-gpu   # one GPU: the setup only (see --help)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import urlparse

import torch


def digest(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


# ---------------------------------------------------------------- receiver (GPU N)

class Recorder(torch.nn.Module):
    """The engine's `load_weights` target: copies what arrives into buffers it keeps (the
    packed consumer's views point into a reused buffer, as a real model's load copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.received: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            kept = self.received.get(name)
            if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                self.received[name] = tensor.clone()
            else:
                kept.copy_(tensor)
            loaded.add(name)
        return loaded


def load_mtp_validation_alone() -> None:
    """`receive_weights` imports `vllm.model_executor.model_loader.mtp_validation` (a ContextVar
    switch); that package's __init__ imports every model loader (fastapi, xgrammar, ...), which
    the carry leaves out. Load vLLM's one file under its name, the package left unexecuted."""
    import importlib.util
    import types

    import vllm.model_executor

    package = "vllm.model_executor.model_loader"
    if package in sys.modules:
        return
    folder = os.path.join(os.path.dirname(vllm.model_executor.__file__), "model_loader")
    stub = types.ModuleType(package)
    stub.__path__ = [folder]
    sys.modules[package] = stub
    spec = importlib.util.spec_from_file_location(
        package + ".mtp_validation", os.path.join(folder, "mtp_validation.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


def make_engine(recorder: Recorder):
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # A single worker: data-parallel index 0, TP*PP world 1, rank 0 (what the engine reads).
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
        model_config=None)
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="nccl"), vllm_config, torch.device("cuda", 0), recorder)


def serve(port: int) -> None:
    torch.cuda.set_device(0)
    load_mtp_validation_alone()
    recorder = Recorder()
    server = make_server(make_engine(recorder), recorder, port)
    print(f"receiver ready on {port}", flush=True)
    server.serve_forever()


def make_server(engine, recorder: Recorder, port: int) -> ThreadingHTTPServer:
    """vLLM's RL routes, each calling the engine the way a vLLM worker does."""
    state = {"version": None}

    def baseline(num_bytes: int, repeats: int) -> None:
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        for _ in range(repeats):
            engine.model_update_group.broadcast(buffer, src=0,
                                                stream=torch.cuda.current_stream())
        torch.cuda.synchronize()

    routes = {
        "/get_world_size": lambda body, q: {"world_size": 1},
        "/init_weight_transfer_engine":
            lambda body, q: engine.init_transfer_engine(engine.parse_init_info(body["init_info"])),
        "/start_weight_update": lambda body, q: None,  # layerwise reload: a real model's
        "/update_weights": lambda body, q: engine.update_weights(body["update_info"]),
        "/finish_weight_update": lambda body, q: None,
        "/update_weight_version": lambda body, q: state.update(version=body["new_version"]),
        "/reset_prefix_cache": lambda body, q: {"success": True},
        "/shutdown_weight_transfer_engine": lambda body, q: engine.shutdown(),
        "/digests": lambda body, q: {"version": state["version"], "digests": {
            name: digest(t) for name, t in recorder.received.items()}},
        "/baseline_broadcast":
            lambda body, q: baseline(int(body["num_bytes"]), int(body["repeats"])),
    }

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else {}
            try:
                result = routes[url.path](body, url.query)
                code, payload = 200, json.dumps(result if result is not None else {})
            except Exception as error:  # noqa: BLE001 (the trainer sees the receiver's error)
                code, payload = 500, json.dumps({"error": repr(error)})
            data = payload.encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


# ---------------------------------------------------------------- trainer (GPU 0..N-1)

def qwen3_0_6b_shaped(layers: int):
    """Qwen3-0.6B's shapes (tied embeddings), random bf16 weights, built on the GPU."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(process: subprocess.Popen, timeout: float = 300.0) -> None:
    began = time.time()
    while time.time() - began < timeout:
        line = process.stdout.readline()
        if not line:
            raise SystemExit(f"the receiver exited (rc {process.poll()}) before it was ready")
        sys.stdout.write("receiver: " + line)
        if line.startswith("receiver ready"):
            threading.Thread(target=lambda: [sys.stdout.write("receiver: " + ln)
                                             for ln in process.stdout], daemon=True).start()
            return
    raise SystemExit("the receiver was not ready in time")


def trainer_digests(model) -> dict[str, str]:
    from grpo_agent.train.weights import full_weights

    with torch.no_grad():
        return {name: digest(t) for name, t in full_weights(model)}


def perturb(model, step: int) -> None:
    """New weights for each push, so the receiver can only match by receiving them."""
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.add_(torch.randn_like(local), alpha=1e-2 * (step + 1))


def point_vllm_at_torchs_nccl() -> None:
    """vLLM's PyNccl loads `libnccl.so.2` by name; name the file of the NCCL wheel torch uses,
    so both ends of the group run the NCCL that torch was built with (inherited by the
    receiver)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        library = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.exists(library):
            os.environ.setdefault("VLLM_NCCL_SO_PATH", library)
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("trainer", "receiver"), default="trainer")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--pushes", type=int, default=4)
    parser.add_argument("--layers", type=int, default=28, help="Qwen3-0.6B has 28")
    parser.add_argument("--same-gpu", action="store_true",
                        help="the receiver on the trainer's GPU (a one-GPU machine): every step "
                        "up to the wire is real, but NCCL moves no bytes between two ranks on "
                        "one device (2.28.9 on an H100: calls return, tensors unchanged), so "
                        "the bit check fails; it shows how far the setup gets, nothing more")
    args = parser.parse_args()
    point_vllm_at_torchs_nccl()
    if args.role == "receiver":
        serve(args.port)
        return

    import torch.distributed as dist
    from grpo_agent.config import AsyncGRPOConfig
    from grpo_agent.train.fsdp import apply_fsdp2
    from grpo_agent.weight_sync.full import WeightPusher

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() < world + (0 if args.same_gpu else 1):
        raise SystemExit(f"needs {world + 1} GPUs ({world} trainer, 1 receiver); "
                         f"{torch.cuda.device_count()} visible")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")

    port = args.port or free_port()
    receiver = None
    if rank == 0:  # the receiver takes the first GPU after the trainers
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = 0 if args.same_gpu else world
        gpu = visible.split(",")[index] if visible else str(index)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "PYTHONUNBUFFERED": "1"}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        receiver = subprocess.Popen(
            [sys.executable, __file__, "--role", "receiver", "--port", str(port)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_ready(receiver)
    try:
        model = apply_fsdp2(qwen3_0_6b_shaped(args.layers))
        config = AsyncGRPOConfig(output_dir="/tmp/nccl_two_gpu", report_to=[],
                                 vllm_server_base_url=f"http://127.0.0.1:{port}")
        pusher = WeightPusher(config, backend="nccl")
        if pusher._sync is not None:  # one host: the rendezvous address is loopback
            pusher._sync.master_address = "127.0.0.1"
        rounds = []
        for step in range(args.pushes):
            perturb(model, step)
            metrics = pusher.push(model, version=step + 1)
            expected = trainer_digests(model)  # every rank gathers
            if rank != 0:
                continue
            sync = pusher._sync
            got = sync.control.call("GET", "/digests")
            mismatched = sorted(n for n in expected if got["digests"].get(n) != expected[n])
            num_bytes = pusher.last_num_bytes
            rounds.append({
                "stall_s": metrics["perf/weight_sync_s"],
                "transfer_s": metrics["perf/weight_sync_transfer_s"],
                "baseline_s": baseline_broadcast(sync, num_bytes),
                "bit_equal": not mismatched and set(got["digests"]) == set(expected),
                "mismatched": mismatched[:5], "version": got["version"],
                "num_bytes": num_bytes, "num_tensors": len(expected),
            })
            print(json.dumps(rounds[-1]), flush=True)
        if rank == 0:
            warm = rounds[1:] or rounds  # the first push opens the NCCL group
            transfer = statistics.median(r["transfer_s"] for r in warm)
            baseline = statistics.median(r["baseline_s"] for r in warm)
            summary = {
                "bench": "nccl_two_gpu", "trainer_processes": world,
                "receiver_gpu": "the trainer's" if args.same_gpu else "its own",
                "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "layers": args.layers, "num_bytes": rounds[-1]["num_bytes"],
                "num_tensors": rounds[-1]["num_tensors"], "pushes": len(rounds),
                "bit_equal": all(r["bit_equal"] for r in rounds),
                "last_version": rounds[-1]["version"],
                "push_transfer_s": transfer, "baseline_broadcast_s": baseline,
                "push_gb_per_s": rounds[-1]["num_bytes"] / transfer / 1e9,
                "baseline_gb_per_s": rounds[-1]["num_bytes"] / baseline / 1e9,
                "bandwidth_fraction": baseline / transfer,
                "stall_s": statistics.median(r["stall_s"] for r in warm),
                "first_push_stall_s": rounds[0]["stall_s"],
            }
        pusher.close()
        if rank == 0:
            print(json.dumps(summary), flush=True)
    finally:
        if receiver is not None:
            receiver.kill()
        dist.destroy_process_group()
    if rank == 0 and not summary["bit_equal"]:
        raise SystemExit("the receiver's tensors differ from the trainer's (see `mismatched`)")


def baseline_broadcast(sync, num_bytes: int, repeats: int = 4) -> float:
    """Seconds for one plain broadcast of `num_bytes` over the push's own communicator, trainer
    to receiver: the first of `repeats + 1` meets the receiver (its HTTP call), the rest are
    timed back to back."""
    group = sync._engine.model_update_group
    buffer = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    thread = threading.Thread(target=sync.control.call, args=("POST", "/baseline_broadcast"),
                              kwargs={"json_body": {"num_bytes": num_bytes,
                                                    "repeats": repeats + 1}})
    thread.start()
    stream = torch.cuda.current_stream()
    group.broadcast(buffer, src=0, stream=stream)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        group.broadcast(buffer, src=0, stream=stream)
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - began) / repeats
    thread.join()
    return elapsed


if __name__ == "__main__":
    main()
