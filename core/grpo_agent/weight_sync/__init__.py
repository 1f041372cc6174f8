"""Weight sync: the trainer's policy pushed into the vLLM server as model version N.

Split by where the code runs:

- trainer side: `pusher.py` (the `Pusher` protocol and the choice of pusher), `full.py`
  (every weight, LoRA merged in) and `adapter.py` (a PEFT model's adapter alone);
- `transports/`: how full weights reach the server (gloo, NCCL, disk) and the control
  routes every push ends with;
- `inside_vllm/`: code vLLM loads into its own processes by module path;
- `wire.py`: the byte layout both ends of the gloo transport share.
"""
