"""`AsyncGRPOConfig`: the spec's configuration, a `transformers.TrainingArguments` subclass.

One source of truth for every knob: the CLI's run files and `--set` overrides are parsed into
this dataclass (`HfArgumentParser` does the typing). Defaults follow the spec, including the
ones it changes from `TrainingArguments`. On a machine without a GPU the bf16 default falls
back to full precision with a logged note instead of failing construction.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from grpo_agent.sampling_limits import check_temperature

logger = logging.getLogger(__name__)
# The process group's timeout becomes a timedelta, then C++ milliseconds: far below either
# limit, and longer than any run (about 31 years).
LONGEST_TIMEOUT_S = 1e9


def _help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


@dataclass
class AsyncGRPOConfig(TrainingArguments):
    """Configuration of `AsyncGRPOTrainer`; see docs/config.md for every field."""

    # ---- TrainingArguments defaults the spec changes ----
    per_device_train_batch_size: int = _help("Unused by packing (kept for API parity).", default=8)
    learning_rate: float = _help("AdamW learning rate.", default=1e-6)
    lr_scheduler_type: str = _help(
        "Scheduler; constant because the number of optimizer steps is not known in advance.",
        default="constant",
    )
    logging_steps: float = _help(
        "Optimizer steps per logging window; below 1 a fraction of max_steps, as are eval_steps "
        "and save_steps (refused without max_steps: a run that ends by its prompt epochs has no "
        "known length in steps).", default=1)
    gradient_checkpointing: bool = _help("Recompute activations in backward.", default=True)
    torch_compile: bool = _help(
        "Compile each decoder layer (dynamic shapes; torch_compile_backend/_mode apply). About "
        "2x faster fwd+bwd on an H200 (docs/performance.md); first steps pay the compile time.",
        default=False,
    )
    cuda_graphs: bool = _help(
        "Replay each packed row's forward+backward as a CUDA graph, one per bucketed row shape "
        "(train/graphed_rows.py), on the tree path the eager row takes (`masked` where "
        "FlashAttention 4 runs, else `varlen`; rows of 12,288+ tokens run eagerly): removes the "
        "host bound of short rows (8k tokens on an H100: docs/performance.md). One CUDA process, dtype bfloat16/float16, "
        "gradient_checkpointing=False, attention-only dense models; each new row shape costs "
        "one warm-up and one capture, so it pays on long runs.",
        default=False,
    )
    bf16: bool | None = _help(
        "bf16 mixed precision; None means True unless fp16 is set (and a GPU supports it).",
        default=None,
    )
    ignore_data_skip: bool = _help(
        "Always True: resume uses rollout_state.json, not batch replay.", default=True
    )
    remove_unused_columns: bool = _help(
        "Must stay False: every dataset column reaches the reward functions.", default=False
    )
    report_to: Any = _help(
        "Integrations to report to, as in transformers; several as a list or comma-separated text "
        "(wandb,tensorboard).", default="none")
    optim: str = _help("Optimizer name, as in transformers.", default="adamw_torch_fused")
    logging_nan_inf_filter: bool = _help(
        "Leave optimizer steps whose loss is NaN/inf out of the logged loss. Checked once per "
        "step, on the values the step's metric read already brings back (no wait per row).",
        default=True,
    )

    # ---- model ----
    model_init_kwargs: dict[str, Any] | str | None = _help(
        "Keyword arguments for from_pretrained when the model is given as a path or id; their "
        "revision (and trust_remote_code) also load the model's config and tokenizer.",
        default=None,
    )
    dtype: str = _help(
        "Weight dtype at load time: auto, bfloat16, float16 or float32. float32 by default because "
        "the train-inference mismatch is sensitive to the trainer's precision.",
        default="float32",
    )
    trust_remote_code: bool = _help(
        "Allow custom model and tokenizer code from the Hub.", default=False
    )
    router_aux_loss_coef: float | None = _help(
        "MoE load-balancing loss coefficient; None uses the model config's value, 0 disables. "
        "Refused on a model without a router.",
        default=None,
    )

    # ---- generation ----
    num_generations: int = _help("Rollouts sampled per prompt (the group size G).", default=8)
    max_completion_length: int = _help("Max tokens generated per vLLM request (per turn).", default=2048)
    temperature: float = _help(
        "Sampling temperature, 0 to 2 (vLLM's range). 0 is greedy: a group's rollouts are one "
        "completion, so on a deterministic env every group is dropped (zero_std; the run warns).",
        default=1.0)
    top_p: float = _help(
        "Nucleus sampling; < 1 requires top_k. Any of top_k/top_p/min_p wants a server started with "
        "--return-sampling-mask (not possible on CPU): without it the run warns and trains with "
        "full-vocabulary log-probs, so importance ratios are biased.", default=1.0)
    top_k: int = _help("Top-k sampling: keep the k most likely tokens; 0 disables.", default=0)
    min_p: float | None = _help("Min-p sampling threshold in [0, 1] (above 0 requires top_k).",
                                default=None)
    repetition_penalty: float = _help("vLLM repetition penalty (1.0 = off).", default=1.0)
    chat_template_kwargs: dict[str, Any] | str | None = _help(
        "Extra keyword arguments for apply_chat_template.", default=None
    )
    max_tool_calling_iterations: int | None = _help(
        "Max tool-calling rounds per rollout; None = no cap (until a turn calls no tool or the "
        "next turn no longer fits the server's max_model_len); 0 = one turn whose tool calls "
        "are not run (counted in tools/loop_exhausted_frac).", default=None
    )

    # ---- vLLM server ----
    vllm_server_base_url: str = _help("Base URL of the vLLM server.", default="http://localhost:8000")
    vllm_server_timeout: float = _help(
        "Seconds for server readiness, each generation request and each weight sync call.",
        default=1800.0,
    )

    # ---- loss ----
    epsilon: float = _help("Lower clipping epsilon of the surrogate objective.", default=0.2)
    epsilon_high: float | None = _help("Upper clipping epsilon; None = epsilon.", default=None)
    score_centering: bool = _help(
        "Subtract the sampler expectation of the importance-weighted score (default) instead of "
        "the clipped surrogate.",
        default=True,
    )
    vllm_importance_sampling_clip_min: float = _help("C_min of masked importance sampling.", default=0.5)
    vllm_importance_sampling_clip_max: float = _help("C_max of masked importance sampling.", default=5.0)
    num_sampler_logprobs: int = _help("Sampler top log-probs requested per token.", default=8)
    token_budget: int | None = _help(
        "Max unique tokens per packed row; None = the server's max_model_len (a larger one of a "
        "server restored mid-run included).", default=None
    )

    # ---- async pipeline ----
    max_concurrent_rollouts: int = _help("Max rollouts in flight.", default=512)
    max_staleness: int = _help("Max weight updates a sample may lag before it is dropped.", default=4)
    weight_sync_steps: int = _help(
        "Optimizer steps between weight pushes (the run's last step pushes too, so it ends "
        "serving its final weights).", default=1)
    rollout_worker_timeout: float = _help(
        "Seconds without a worker heartbeat before the trainer aborts.", default=300.0
    )
    tool_timeout_s: float = _help(
        "Seconds one tool call may run; a late call becomes an error message the model sees.",
        default=300.0,
    )
    share_first_turn_request: bool = _help(
        "Not a spec field (grpo-agent only). True: a group's rollouts whose first prompts are "
        "equal get their first turns from one vLLM request with n samples (the server shares "
        "the prompt; later turns go per rollout); False: one request per rollout.",
        default=True,
    )
    stall_timeouts: dict[str, float] = _help(
        "Deadline in seconds by stage, overriding the derived one (docs/reliability.md): "
        "vllm_generate, tool, env_reset, env_finish, scoring, queue_pull, weight_sync (or one "
        "phase: weight_sync/transfer, ...), checkpoint_save, collective (FSDP). A late stage writes "
        "stall_report.json; a rollout stage is dropped and counted, any other stops the run.",
        default_factory=dict,
    )
    no_progress_timeout: float = _help(
        "Seconds with every group dropped (zero reward std, unscored or stalled) and no "
        "trainable sample before the run stops with a stall report; 0 = never.", default=1800.0
    )

    # ---- plugins (names resolved through the plugin host) ----
    advantage_estimator: str = _help("Registered advantage estimator name.", default="group_norm")
    prompt_filters: list[str] = _help(
        "Registered prompt filter names, all of which must accept a prompt (a text is read "
        "as comma-separated names).",
        default_factory=list,
    )
    plugin_args: dict[str, Any] = _help(
        "Options of the selected plugins, by registered name: {name: {option: value}} "
        "(`--plugin-arg name.option=value`; `grpo-agent plugins list` shows each plugin's).",
        default_factory=dict,
    )

    # ---- evaluation (eval_strategy, eval_steps, eval_on_start as in TrainingArguments) ----
    eval_temperature: float = _help(
        "Sampling temperature of evaluation rollouts, 0 to 2; 0 = greedy (the same weights give "
        "the same answers). per_device_eval_batch_size is the number of eval rollouts in flight.",
        default=0.0,
    )
    eval_num_generations: int = _help(
        "Rollouts per eval row: eval/pass@1 and, above 1, eval/pass@{k} with k = this.", default=1
    )
    eval_success_threshold: float | None = _help(
        "A rollout passes (eval/pass@*) when its summed reward reaches this; None = the env's "
        "declared success_threshold, else 1.0.",
        default=None,
    )

    # ---- logging ----
    log_completions: bool = _help("Log a sample of completions every logging window.", default=False)
    num_completions_to_print: int | None = _help("Completions printed with rich; None = all.", default=None)

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = not self.fp16 and _bf16_supported(self)
        if _launched_on_cpu_with_several_processes():
            # Without use_cpu, transformers sees a torchrun launch on CPU as one process: every
            # rank would then log, save checkpoints and count itself as the main process.
            self.use_cpu = True
        self._check()
        from grpo_agent.stall import process_group_timeout

        # The process group (created by transformers from ddp_timeout) must outwait every
        # collective phase, so a phase's stall report and exit come first (stall.py).
        timeout = process_group_timeout(self)
        if not timeout < LONGEST_TIMEOUT_S:  # else an OverflowError traceback, naming no field
            raise ValueError(
                f"vllm_server_timeout={self.vllm_server_timeout}, rollout_worker_timeout="
                f"{self.rollout_worker_timeout}, stall_timeouts={self.stall_timeouts}: the process "
                "group's timeout (ddp_timeout) is derived from these, and an infinite one (or one "
                f"of {LONGEST_TIMEOUT_S:.0e} s or more) leaves it none. Set each to a finite number "
                "of seconds.")
        self.ddp_timeout = max(int(self.ddp_timeout), math.ceil(timeout))
        super().__post_init__()

    def _check(self) -> None:
        if isinstance(self.prompt_filters, str):  # `--set prompt_filters=a,b` or a run file's "a"
            self.prompt_filters = _comma_separated(self.prompt_filters)
        if isinstance(self.report_to, str) and "," in self.report_to:  # `--set report_to=wandb,tensorboard`
            self.report_to = _comma_separated(self.report_to)  # one name stays text, as transformers takes it
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations}: group-normalised advantages need at "
                "least 2 rollouts per prompt; set num_generations >= 2."
            )
        if not self.ignore_data_skip:
            raise ValueError(
                "ignore_data_skip must be True: resume restores the rollout position from "
                "rollout_state.json instead of replaying batches."
            )
        if self.remove_unused_columns:
            raise ValueError(
                "remove_unused_columns must be False: every dataset column is passed to the "
                "reward functions."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1].")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1] (null or 0 = off).")
        needs_top_k = self.top_p < 1.0 or (self.min_p or 0.0) > 0.0
        if needs_top_k and self.top_k <= 0:
            raise ValueError(
                "top_p < 1 or min_p > 0 requires top_k > 0: vLLM uses top_k to bound the sampling "
                "candidate set. Set top_k (e.g. 512)."
            )
        # Bounds here and in _check_ranges read `not <valid>`: NaN (`--set epsilon=NaN`, a TOML
        # `nan`) fails every comparison, so `value < low` let it into the loss and the timeouts.
        if not self.vllm_importance_sampling_clip_min < self.vllm_importance_sampling_clip_max:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={self.vllm_importance_sampling_clip_min} must be "
                f"below vllm_importance_sampling_clip_max={self.vllm_importance_sampling_clip_max}."
            )
        from grpo_agent.stall import check_stall_timeouts

        check_stall_timeouts(self.stall_timeouts)
        self._check_ranges()
        self._check_step_fractions()
        self._check_step_intervals()
        eval_strategy = str(getattr(self.eval_strategy, "value", self.eval_strategy))
        if eval_strategy == "no" and self.eval_steps is not None:  # transformers ignores it
            raise ValueError(
                f"eval_steps={self.eval_steps} is set but eval_strategy='no', so the run never "
                "evaluates every eval_steps. Add eval_strategy=steps (--set eval_strategy=steps), "
                "or remove eval_steps.")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"dtype={self.dtype!r}: choose one of auto, bfloat16, float16, float32."
            )
        self.parallelism_config = _parallelism_config(self.parallelism_config)
        _refuse_unsupported_features(self)
        self._check_report_to()
        if self.cuda_graphs and self.gradient_checkpointing:
            raise ValueError("cuda_graphs=True needs gradient_checkpointing=False: the "
                             "recomputation in backward is not captured. Turn one of them off.")
        if self.cuda_graphs and self.fp16:
            raise ValueError("cuda_graphs=True does not run with fp16: its loss scaler acts "
                             "outside the captured backward. Use bf16 or turn cuda_graphs off.")

    def _check_ranges(self) -> None:
        """Bounds of values that would fail far from the flag (vLLM refuses every request: a
        temperature below 0 or above 2, max_tokens 0, repetition_penalty 0; no sample fits the
        token budget; a timeout expires at once) or be quietly misread (a negative count or loss
        coefficient; top_k=-1, vLLM's "off", where the spec's is 0)."""
        for name in ("temperature", "eval_temperature"):
            check_temperature(name, getattr(self, name))
        minimums = (  # (field, lowest valid value, strict, what the value means)
            ("max_completion_length", 1, False, "tokens per turn"),
            ("top_k", 0, False, "0 = no top-k"),
            ("max_tool_calling_iterations", 0, False, "null = no cap, 0 = no tool call is run"),
            ("token_budget", 1, False, "null = the server's max_model_len"),
            ("num_sampler_logprobs", 0, False, "top log-probs per token"),
            ("router_aux_loss_coef", 0, False, "null = the model config's, 0 = off"),
            ("num_completions_to_print", 0, False, "null = all"),
            ("epsilon", 0, False, "the lower clip"), ("epsilon_high", 0, False, "null = epsilon"),
            ("learning_rate", 0, False, "0 = no update"),
            ("repetition_penalty", 0, True, "1.0 = off"),
            ("vllm_server_timeout", 0, True, "seconds"), ("rollout_worker_timeout", 0, True, "seconds"),
            ("tool_timeout_s", 0, True, "seconds per tool call"),
            ("no_progress_timeout", 0, False, "0 = never"),
            ("max_staleness", 0, False, "0 = on-policy"),
            ("weight_sync_steps", 1, False, "optimizer steps between weight pushes"),
            ("max_concurrent_rollouts", 1, False, "rollouts in flight"),
        )
        for name, low, strict, meaning in minimums:
            value = getattr(self, name)
            if value is not None and not (value > low if strict else value >= low):
                raise ValueError(f"{name}={value} is out of range: set {name} "
                                 f"{'>' if strict else '>='} {low} ({meaning}).")
        if self.eval_success_threshold is not None and math.isnan(self.eval_success_threshold):
            raise ValueError("eval_success_threshold=nan: no reward reaches it, so every evaluation "
                             "rollout would fail. Set the summed reward a passing rollout reaches, "
                             "or null for the env's declared success_threshold.")

    def _check_step_intervals(self) -> None:
        """A `*_steps` interval of a steps strategy must be > 0; transformers misread the others
        without a word: save_steps <= 0 ran to the end with no checkpoint (it saves only `if
        save_steps > 0`), eval_steps=0 evaluated every logging_steps (its rule for an unset
        eval_steps), and a negative eval or logging interval counted steps modulo a negative
        number (-1 with max_steps=10 acted every 10 steps)."""
        for kind in ("logging", "eval", "save"):
            strategy = getattr(self, f"{kind}_strategy")
            value = getattr(self, f"{kind}_steps")
            if str(getattr(strategy, "value", strategy)) != "steps" or value is None or value > 0:
                continue
            if kind == "save":
                raise ValueError(
                    f"save_steps={value} with save_strategy='steps' never saves a checkpoint. "
                    "Set save_steps to a number of steps (>= 1), or save_strategy='no' to save none.")
            why = (" (transformers would act on steps modulo a negative number)" if value < 0
                   else " (transformers would evaluate every logging_steps instead)"
                   if kind == "eval" else "")
            unset = ", or leave it unset to evaluate every logging_steps" if kind == "eval" else ""
            raise ValueError(
                f"{kind}_steps={value} with {kind}_strategy='steps' is no interval{why}. Set "
                f"{kind}_steps to a number of steps (>= 1) or, with max_steps set, a fraction of "
                f"it below 1{unset}.")

    def _check_step_fractions(self) -> None:
        """A run without max_steps is as long as its prompt epochs: none trains nothing.
        transformers reads logging/eval/save steps below 1 as a fraction of max_steps; a run
        without max_steps ends by its prompt epochs, its length in steps unknown (the Trainer
        sees 10**9 steps), so such a window never came: no metrics row, evaluation or checkpoint."""
        if self.max_steps > 0:
            return
        if self.num_train_epochs <= 0:  # the run "finished" after one empty step, untrained
            raise ValueError(
                f"num_train_epochs={self.num_train_epochs} and max_steps is not set: the run would "
                "train nothing. Set num_train_epochs > 0 (a fraction such as 0.5 trains on that "
                "share of the prompts), or set max_steps.")
        for kind in ("logging", "eval", "save"):
            strategy = getattr(self, f"{kind}_strategy")
            value = getattr(self, f"{kind}_steps")
            if str(getattr(strategy, "value", strategy)) == "steps" and value is not None and 0 < value < 1:
                raise ValueError(
                    f"{kind}_steps={value} is a fraction of max_steps, but max_steps is not set: the "
                    "run ends by its prompt epochs, so its length in steps is unknown. Set "
                    f"{kind}_steps to a number of steps (>= 1), or set max_steps.")

    def _check_report_to(self) -> None:
        """An unknown integration (`--set report_to=bogus`), None, or none/all among others
        failed only when the Trainer was built, once the server was up, naming no field."""
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

        if self.report_to is None:  # a run file's `report_to: null`; transformers makes it [None]
            raise ValueError("report_to=None is no setting: transformers keeps it as [None] and its "
                             "Trainer refuses that. Use none (no reporting), all, or integration "
                             "names (--set report_to=wandb,tensorboard).")
        names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        unknown = [name for name in names if name not in ("all", "none", *INTEGRATION_TO_CALLBACK)]
        if unknown:
            raise ValueError(
                f"report_to={self.report_to!r}: {', '.join(map(repr, unknown))} is no integration "
                f"transformers knows. Use none, all or some of {', '.join(INTEGRATION_TO_CALLBACK)} "
                "(several comma-separated: --set report_to=wandb,tensorboard).")
        alone = [name for name in names if name in ("all", "none")]
        if alone and len(names) > 1:  # transformers kept the list, and its Trainer refused 'none'
            raise ValueError(
                f"report_to={self.report_to!r}: {alone[0]!r} stands alone, not among other "
                f"integrations. Use {alone[0]} by itself, or list only integrations "
                "(--set report_to=wandb,tensorboard).")

    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _comma_separated(text: str) -> list[str]:
    """Names given as one text (`--set`, a run file): `a, b` is ["a", "b"], not its letters."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _refuse_unsupported_features(args: AsyncGRPOConfig) -> None:
    """The spec's refusals (Liger, DeepSpeed, context/sequence parallelism), each with what to
    do instead; checked before transformers acts on them (it would import DeepSpeed)."""
    if args.use_liger_kernel:
        raise ValueError(
            "use_liger_kernel=True is not supported: the trainer never calls the model's loss "
            "(it computes log-probs in vocabulary tiles without materialising the logits), so "
            "Liger's kernels would only patch the model. Remove use_liger_kernel."
        )
    if args.deepspeed:
        raise ValueError(
            "deepspeed is not supported: sharded training uses FSDP2. Remove deepspeed and "
            "launch one process per GPU with torchrun or accelerate launch; the trainer shards "
            "the model with FSDP2 itself."
        )
    parallel = args.parallelism_config
    cp_size, sp_size = getattr(parallel, "cp_size", None) or 1, getattr(parallel, "sp_size", None) or 1
    if cp_size > 1 or sp_size > 1:
        raise ValueError(
            f"parallelism_config with cp_size={cp_size}, sp_size={sp_size}: context and sequence "
            "parallelism are not supported (each packed row is trained whole on one process). "
            "Set cp_size and sp_size to 1 (or leave parallelism_config unset); for longer rows "
            "raise token_budget or add GPUs to FSDP2."
        )


def _parallelism_config(value: Any) -> Any:
    """A run file's `[parallelism_config]` table (or `--set 'parallelism_config={...}'`) as
    accelerate's ParallelismConfig: kept a dict, it passed the checks and then broke `config
    show` and the run's config.json ("'dict' object has no attribute 'to_json'")."""
    if value is None:
        return None
    from dataclasses import fields

    from accelerate.parallelism_config import ParallelismConfig

    if isinstance(value, ParallelismConfig):
        return value
    known = [f.name for f in fields(ParallelismConfig) if f.init]
    if not isinstance(value, dict) or not set(value) <= set(known):
        raise ValueError(
            f"parallelism_config={value!r}: give a table of some of {', '.join(known)} "
            "(e.g. --set 'parallelism_config={\"dp_shard_size\": 2}').")
    return ParallelismConfig(**value)


def _bf16_supported(args: AsyncGRPOConfig) -> bool:
    import torch

    if not args.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return True
    logger.info("No bf16-capable GPU found: training in full precision (bf16=False).")
    return False


def config_reference_markdown() -> str:
    """The fields AsyncGRPOConfig adds or re-defaults, as a markdown table (docs/config.md)."""
    from dataclasses import MISSING, fields

    own = AsyncGRPOConfig.__annotations__  # fields declared (or re-defaulted) here
    lines = [
        "# AsyncGRPOConfig reference",
        "",
        "Generated from `grpo_agent.config` (`python -m grpo_agent.config > docs/config.md`).",
        "Fields not listed behave as in `transformers.TrainingArguments`, except that the Trainer",
        "sees a run as one epoch (its prompt epochs are counted apart): `logging_strategy` and",
        "`save_strategy` `\"epoch\"` act once, after the run's last step (`eval_strategy`:",
        "docs/evaluation.md), and `logging_steps`, `eval_steps` or `save_steps` below 1 need `max_steps`",
        "(under a `\"steps\"` strategy each must be above 0: 0 or less is refused).",
        "",
        "| field | default | meaning |",
        "|---|---|---|",
    ]
    for f in fields(AsyncGRPOConfig):
        if f.name not in own:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        text = f.metadata.get("help", "").replace("|", "\\|")
        lines.append(f"| `{f.name}` | `{default!r}` | {text} |")
    return "\n".join(lines) + "\n"


def _launched_on_cpu_with_several_processes() -> bool:
    import os

    import torch

    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


if __name__ == "__main__":
    print(config_reference_markdown(), end="")

