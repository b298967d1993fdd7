"""The base experiment config: every key, its default and a one-line description, in one table.

Keys mirror verl's ``ppo_trainer.yaml`` wherever verl has one (``data.*``,
``actor_rollout_ref.*``, ``critic.*``, ``reward_model.*``, ``custom_reward_function.*``,
``algorithm.*``, ``trainer.*``; verl's ``*_per_gpu`` is spelled ``*_per_device``). jaxflow's
own settings live under ``jaxflow.*``.

Batch sizes follow verl: ``data.train_batch_size`` and ``ppo_mini_batch_size`` count
*prompts*; each prompt gets ``actor_rollout_ref.rollout.n`` responses, so a mini-batch (one
optimizer step) holds ``ppo_mini_batch_size * n`` responses, split over the role's
data-parallel ranks (``dp * fsdp`` of its training mesh). ``*_micro_batch_size_per_device``
counts *responses* per data-parallel rank per forward/backward pass (gradient accumulation).

The defaults are a complete, valid CPU experiment (PPO with a critic on the built-in addition
task, a tiny Llama on 8 simulated devices), so a config file may start from
:func:`get_base_config` and change a few keys. ``KEY_DOCS`` documents every key; ``python -m
jaxflow.configs.docs`` prints it as a markdown table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from ml_collections import ConfigDict, config_dict


@dataclasses.dataclass(frozen=True)
class Optional_:
    """Marks a key whose value may be ``None`` (its default); ``type`` is what else it holds."""

    type: type


def _opt(t: type) -> Optional_:
    return Optional_(t)


@dataclasses.dataclass(frozen=True)
class Bound:
    """A key's allowed values, checked alike for every key by `jaxflow.configs.validate`
    (None passes for an optional key; a sequence is checked element by element): ``lo`` ..
    ``hi``, each end closed or open as ``ends`` says (``"[]"``, ``"(]"``, ``"[)"``, ``"()"``),
    or one of ``also``. An error states it as ``text`` (default: the interval) plus ``note``.
    ``when``: checked only while that part of the run is on (``critic``: a critic runs;
    ``adaptive_kl``: the adaptive KL controller)."""

    lo: float = -math.inf
    hi: float = math.inf
    ends: str = "[]"
    also: tuple[float, ...] = ()
    text: str = ""
    note: str = ""
    when: str = ""

    def holds(self, value: float) -> bool:
        above = self.lo < value if self.ends[0] == "(" else self.lo <= value
        below = value < self.hi if self.ends[1] == ")" else value <= self.hi
        return value in self.also or (above and below)

    def describe(self) -> str:
        """``>= 1``, ``> 0``, ``in (0, 1]``, or ``text``; then ``note``."""
        if self.text:
            words = self.text
        elif self.hi == math.inf:
            words = f"{'>' if self.ends[0] == '(' else '>='} {self.lo:g}"
        else:
            words = f"in {self.ends[0]}{self.lo:g}, {self.hi:g}{self.ends[1]}"
        return words + self.note


AT_LEAST_1 = Bound(lo=1)
AT_LEAST_0 = Bound(lo=0)
POSITIVE = Bound(lo=0, ends="(]")
FRACTION = Bound(0, 1)
STEPS_OR_NEVER = Bound(lo=1, also=(-1,), text="-1 (never) or >= 1 steps")


class Field(NamedTuple):
    """One row of `FIELDS`: the dotted key, its default (``_opt(T)``: None, else a T), its
    one-line description, and its allowed values (None: any of its type)."""

    key: str
    default: Any
    doc: str
    bound: Bound | None = None


_MESH_DOC = "{role}: size of the {axis} axis of its mesh ({what}); -1 = what the pool leaves."


def _mesh_fields(prefix: str, role: str, dp: int = 1, fsdp: int = -1, tp: int = 1) -> list[tuple[str, Any, str]]:
    what = {
        "dp": "data parallel, weights replicated",
        "fsdp": "data parallel, weights sharded",
        "tp": "tensor parallel",
    }
    return [
        (f"{prefix}.{axis}", size, _MESH_DOC.format(role=role, axis=axis, what=what[axis]))
        for axis, size in (("dp", dp), ("fsdp", fsdp), ("tp", tp))
    ]


def _optim_fields(prefix: str, lr: float, when: str = "") -> list[tuple]:
    """An optimizer's keys; ``when``: the part of the run that must be on for their bounds to
    be checked (the critic's)."""
    return [
        (f"{prefix}.lr", lr, "Peak learning rate (AdamW).", Bound(lo=0, ends="(]", when=when)),
        (f"{prefix}.lr_warmup_steps", -1, "Linear warmup steps; negative = use lr_warmup_steps_ratio (0 = no warmup)."),
        (
            f"{prefix}.lr_warmup_steps_ratio",
            0.0,
            "Warmup steps as a fraction of the total training steps.",
            Bound(0, 1, when=when),
        ),
        (f"{prefix}.warmup_style", "constant", "LR schedule after warmup: constant | cosine."),
        (f"{prefix}.min_lr_ratio", 0.0, "Final LR / peak LR for the cosine schedule.", Bound(0, 1, when=when)),
        (f"{prefix}.weight_decay", 0.01, "AdamW decoupled weight decay.", Bound(lo=0, when=when)),
        (f"{prefix}.betas", (0.9, 0.999), "AdamW (beta1, beta2).", Bound(0, 1, "[)", when=when)),
    ]


# (key, default, one-line description[, bound]). ``_opt(T)`` defaults to None and otherwise
# holds a T; a `Bound` says what values the key takes (`Field`).
FIELDS: tuple[Field, ...] = tuple(
    Field(*row)
    for row in [
        # --- data (verl) ---------------------------------------------------------------------
        (
            "data.train_files",
            "",
            "Training prompts: a .parquet/.jsonl path, or comma-separated paths (verl schema); empty = the built-in task "
            "jaxflow.data.builtin_task.",
        ),
        ("data.val_files", "", "Validation prompts, same format; empty = the built-in task's test split."),
        ("data.prompt_key", "prompt", "Column holding the prompt (a chat message list or a string)."),
        (
            "data.reward_fn_key",
            "data_source",
            "Column that selects the rule-based reward function (verl's key; only data_source is supported).",
        ),
        ("data.max_prompt_length", 16, "Prompt length P in tokens; prompts are left-padded to P.", AT_LEAST_1),
        ("data.max_response_length", 8, "Response length R in tokens; generation stops at EOS or R.", AT_LEAST_1),
        ("data.train_batch_size", 64, "Prompts per training step (each gets rollout.n responses).", AT_LEAST_1),
        (
            "data.val_batch_size",
            _opt(int),
            "Prompts per validation batch; None = the whole validation set at once.",
            AT_LEAST_1,
        ),
        ("data.truncation", "error", "Prompts longer than P: error | left | right | filter (drop)."),
        ("data.shuffle", True, "Shuffle the training prompts each epoch."),
        ("data.seed", 1, "Seed of the prompt shuffling."),
        # --- actor / rollout / reference (verl) ------------------------------------------------
        (
            "actor_rollout_ref.model.path",
            "",
            "Actor (and reference) weights: an HF checkpoint directory (e.g. the sft_tiny output), 'preset:NAME', or empty "
            "= jaxflow.model.preset randomly initialised.",
        ),
        (
            "actor_rollout_ref.model.use_remove_padding",
            False,
            "Actor and reference log-prob / update forwards over packed real tokens (no padding; same values).",
        ),
        (
            "actor_rollout_ref.model.lora_rank",
            0,
            "LoRA: train rank-r adapters on the actor's projections instead of its weights (frozen, bf16 on GPU/TPU "
            "with jaxflow.model.dtype=auto); the reference policy is then the base model (the adapters switched off, "
            "no second copy); 0 = full fine-tuning.",
        ),
        ("actor_rollout_ref.model.lora_alpha", 16.0, "LoRA: the adapters' update is scaled by lora_alpha / lora_rank."),
        (
            "actor_rollout_ref.model.target_modules",
            "all-linear",
            "LoRA: the projections that get adapters: all-linear (every projection, not the LM head) or names among "
            "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (comma-separated).",
        ),
        ("actor_rollout_ref.model.lora_dropout", 0.0, "LoRA: dropout on the adapters' input in training, in [0, 1)."),
        (
            "actor_rollout_ref.model.lora_adapter_path",
            "",
            "LoRA: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors, e.g. an earlier run's "
            "export or an SFT adapter) the adapters start from; its config gives the rank, alpha, targets and dropout "
            "(lora_rank may stay 0). Empty = fresh adapters.",
        ),
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            32,
            "Prompts per PPO mini-batch (one optimizer step); holds ppo_mini_batch_size * rollout.n responses.",
            AT_LEAST_1,
        ),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_device",
            4,
            "Responses per data-parallel rank per forward/backward pass (gradient accumulation).",
            AT_LEAST_1,
        ),
        ("actor_rollout_ref.actor.ppo_epochs", 1, "Passes over each training batch.", AT_LEAST_1),
        (
            "actor_rollout_ref.actor.use_dynamic_bsz",
            False,
            "With use_remove_padding: update micro-batches by a token budget (ppo_max_token_len_per_device), not rows.",
        ),
        (
            "actor_rollout_ref.actor.ppo_max_token_len_per_device",
            16384,
            "Token budget of one update micro-batch per data-parallel rank (use_dynamic_bsz).",
        ),
        ("actor_rollout_ref.actor.shuffle", False, "Reshuffle the batch into mini-batches at every PPO epoch."),
        ("actor_rollout_ref.actor.grad_clip", 1.0, "Global gradient-norm clip; <= 0 disables clipping."),
        ("actor_rollout_ref.actor.clip_ratio_low", 0.2, "PPO ratio clip below: 1 - clip_ratio_low.", Bound(0, 1, "()")),
        ("actor_rollout_ref.actor.clip_ratio_high", 0.2, "PPO ratio clip above: 1 + clip_ratio_high.", POSITIVE),
        (
            "actor_rollout_ref.actor.clip_ratio_c",
            3.0,
            "Dual-clip PPO bound for negative advantages (> 1); dppo_tv / dppo_kl: the truncation of their IS ratio.",
            Bound(lo=1, ends="(]", note=" (the dual-clip bound)"),
        ),
        ("actor_rollout_ref.actor.tau_pos", 1.0, "sapo: gate temperature of tokens with a positive advantage (> 0)."),
        ("actor_rollout_ref.actor.tau_neg", 1.05, "sapo: gate temperature of the other tokens (> 0)."),
        (
            "actor_rollout_ref.actor.loss_agg_mode",
            "token-mean",
            "Policy-loss aggregation: token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-"
            "sum-norm.",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode",
            "vanilla",
            "Policy loss from the registry: vanilla | gspo | gpg | cispo | clip_cov | kl_cov | geo_mean | dppo_tv | "
            "dppo_kl (clip_ratio_low/high are then divergence thresholds) | sapo | dro | bypass_mode (set by "
            "algorithm.rollout_correction.bypass_mode) | a registered name.",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
            0.0002,
            "clip_cov: fraction of tokens whose gradient is clipped.",
        ),
        ("actor_rollout_ref.actor.policy_loss.clip_cov_lb", 1.0, "clip_cov: lower bound of the covariance window."),
        ("actor_rollout_ref.actor.policy_loss.clip_cov_ub", 5.0, "clip_cov: upper bound of the covariance window."),
        (
            "actor_rollout_ref.actor.policy_loss.kl_cov_ratio",
            0.0002,
            "kl_cov: fraction of tokens that get the KL penalty.",
        ),
        ("actor_rollout_ref.actor.policy_loss.ppo_kl_coef", 0.1, "kl_cov: coefficient of that KL penalty."),
        (
            "actor_rollout_ref.actor.policy_loss.dro_beta",
            _opt(float),
            "dro: coefficient beta (> 0, required) of the quadratic log-ratio penalty beta/2 (log pi - log pi_old)^2.",
        ),
        ("actor_rollout_ref.actor.entropy_coeff", 0.0, "Entropy bonus coefficient in the actor loss."),
        (
            "actor_rollout_ref.actor.use_kl_loss",
            False,
            "Add a KL(actor || ref) loss term (GRPO style) instead of / besides the in-reward penalty.",
        ),
        (
            "actor_rollout_ref.actor.kl_loss_type",
            "low_var_kl",
            "KL estimator of that loss: kl (k1) | abs | mse (k2) | low_var_kl (k3), '+' suffix = straight-through k2"
            " gradient.",
        ),
        ("actor_rollout_ref.actor.kl_loss_coef", 0.001, "Coefficient of the KL loss.", AT_LEAST_0),
        *_optim_fields("actor_rollout_ref.actor.optim", 1e-4),
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device",
            16,
            "Responses per data-parallel rank per reference log-prob forward pass.",
            AT_LEAST_1,
        ),
        (
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
            False,
            "With use_remove_padding: reference forward micro-batches by a token budget, not rows.",
        ),
        (
            "actor_rollout_ref.ref.log_prob_max_token_len_per_device",
            16384,
            "Token budget of one reference forward micro-batch per data-parallel rank.",
        ),
        (
            "actor_rollout_ref.rollout.n",
            1,
            "Responses sampled per prompt (>= 2 for group baselines: grpo, rloo, ...).",
            AT_LEAST_1,
        ),
        ("actor_rollout_ref.rollout.temperature", 1.0, "Sampling temperature.", AT_LEAST_0),
        ("actor_rollout_ref.rollout.top_p", 1.0, "Nucleus sampling mass in (0, 1]; 1 = off.", Bound(0, 1, "(]")),
        (
            "actor_rollout_ref.rollout.top_k",
            -1,
            "Top-k sampling; -1 or 0 = off.",
            Bound(lo=-1, text="-1 or 0 (off) or a positive k"),
        ),
        ("actor_rollout_ref.rollout.do_sample", True, "Sample (True) or decode greedily (False)."),
        (
            "actor_rollout_ref.rollout.ignore_eos",
            False,
            "Keep generating past EOS to the full response length (throughput benchmarks).",
        ),
        (
            "actor_rollout_ref.rollout.max_num_seqs",
            0,
            "Decode slots per generation data-parallel group: sequences decoded at once, a finished one's slot refilled; "
            "0 = the engine's default (every row, at most 256).",
            AT_LEAST_0,
        ),
        (
            "actor_rollout_ref.rollout.max_total_tokens",
            0,
            "KV-cache budget per generation data-parallel group, in tokens (sglang's max_total_tokens): the page pool's "
            "size; a sequence that finds no free page waits for one; 0 = the engine's default (the prompts alive and a "
            "quarter of every slot's response length).",
            AT_LEAST_0,
        ),
        (
            "actor_rollout_ref.rollout.stop",
            [],
            "Stop strings (vLLM's stop): a response ends after the token that completes one (kept, like EOS); matched "
            "on the device through the tokenizer. Training and validation rollouts.",
        ),
        (
            "actor_rollout_ref.rollout.stop_token_ids",
            [],
            "Token ids that end a response like EOS (vLLM's stop_token_ids), besides the tokenizer's EOS.",
        ),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_device",
            16,
            "Responses per data-parallel rank per old-log-prob forward pass of the actor.",
            AT_LEAST_1,
        ),
        (
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
            False,
            "With use_remove_padding: old-log-prob forward micro-batches by a token budget, not rows.",
        ),
        (
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_device",
            16384,
            "Token budget of one old-log-prob forward micro-batch per data-parallel rank.",
        ),
        (
            "actor_rollout_ref.rollout.multi_turn.enable",
            False,
            "Multi-turn rollouts with tools: each sample alternates model turns and tool turns (the calls parsed from "
            "the model's text, run on host threads, their answers appended as untrained tokens) until it answers "
            "without a call, max_assistant_turns or data.max_response_length; only the model's tokens train "
            "(loss_mask). Training and validation rollouts.",
        ),
        (
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
            4,
            "Multi-turn: model turns per conversation (the last one's tool calls are not run).",
            AT_LEAST_1,
        ),
        (
            "actor_rollout_ref.rollout.multi_turn.max_user_turns",
            0,
            "Multi-turn: tool and environment turns per conversation (0: no limit, verl's null); at the limit the "
            "conversation ends after the model's turn.",
            AT_LEAST_0,
        ),
        (
            "actor_rollout_ref.rollout.multi_turn.format",
            "hermes",
            "Multi-turn: the tool-call format the model writes: hermes (Qwen2.5/Qwen3: <tool_call>{json}</tool_call>) "
            "or llama3 (<|python_tag|>{json}).",
        ),
        (
            "actor_rollout_ref.rollout.multi_turn.tool_config_path",
            "",
            "Multi-turn: a JSON (or YAML) file of tools: {'tools': [{'name': <built-in>} or {'callable': "
            "'file.py:function', 'tool_schema': {'type': 'function', 'function': {name, description, parameters}}, "
            "'timeout_s': 10}]} (jaxflow.agents.rollout).",
        ),
        (
            "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
            "",
            "Multi-turn: a JSON (or YAML) file {'interaction': [{'name': ..., 'callable': 'file.py:Factory', 'config': "
            "{...}}]}: Factory(**config) builds each conversation's environment (reset(sample) -> first observation; "
            "step(model turn) -> (observation, reward, done)), whose rewards add to the reward's on the turns' last "
            "tokens.",
        ),
        (
            "jaxflow.agent.tools",
            [],
            "Multi-turn: built-in tools by name (calculator: exact arithmetic), besides multi_turn.tool_config_path's.",
        ),
        (
            "jaxflow.agent.reuse_kv",
            True,
            "Multi-turn: keep each conversation's KV pages in the engine between its turns (a turn prefills only "
            "what was appended) when the generation mesh is one replica (several would each run every "
            "conversation); its page pool holds every conversation at its longest, beyond "
            "rollout.max_total_tokens. Otherwise (or false): every turn re-prefilled, the conversations split over "
            "the replicas, the engine's budgeted pool.",
        ),
        ("actor_rollout_ref.rollout.val_kwargs.n", 1, "Validation: responses per prompt.", AT_LEAST_1),
        (
            "actor_rollout_ref.rollout.val_kwargs.temperature",
            0.0,
            "Validation: sampling temperature (0 with do_sample=False = greedy).",
            AT_LEAST_0,
        ),
        ("actor_rollout_ref.rollout.val_kwargs.top_p", 1.0, "Validation: nucleus sampling mass.", Bound(0, 1, "(]")),
        (
            "actor_rollout_ref.rollout.val_kwargs.top_k",
            -1,
            "Validation: top-k; -1 or 0 = off.",
            Bound(lo=-1, text="-1 or 0 (off) or a positive k"),
        ),
        ("actor_rollout_ref.rollout.val_kwargs.do_sample", False, "Validation: sample (True) or greedy (False)."),
        # --- critic (verl) ---------------------------------------------------------------------
        ("critic.enable", _opt(bool), "Run a critic (value model); None = only when algorithm.adv_estimator is gae."),
        (
            "critic.model.path",
            "",
            "Critic weights (value head on the decoder): HF checkpoint directory, 'preset:NAME', or empty = the actor's "
            "model.",
        ),
        *_optim_fields("critic.optim", 1e-3, when="critic"),
        ("critic.model.use_remove_padding", False, "Critic value / update forwards over packed real tokens."),
        (
            "critic.model.lora_rank",
            0,
            "LoRA on the critic: train rank-r adapters on its projections and its value head (PEFT's "
            "modules_to_save) instead of every weight; the base stays frozen (bf16 on GPU/TPU with "
            "jaxflow.model.dtype=auto); 0 = full fine-tuning.",
        ),
        ("critic.model.lora_alpha", 16.0, "Critic LoRA: the adapters' update is scaled by lora_alpha / lora_rank."),
        (
            "critic.model.target_modules",
            "all-linear",
            "Critic LoRA: the projections that get adapters (as actor_rollout_ref.model.target_modules).",
        ),
        ("critic.model.lora_dropout", 0.0, "Critic LoRA: dropout on the adapters' input in training, in [0, 1)."),
        (
            "critic.use_dynamic_bsz",
            False,
            "With critic.model.use_remove_padding: critic micro-batches by token budgets, not rows.",
        ),
        ("critic.ppo_max_token_len_per_device", 32768, "Token budget of one critic update micro-batch per rank."),
        ("critic.forward_max_token_len_per_device", 32768, "Token budget of one value forward micro-batch per rank."),
        (
            "critic.ppo_mini_batch_size",
            32,
            "Prompts per critic mini-batch (times rollout.n responses), as the actor's.",
            Bound(lo=1, when="critic"),
        ),
        (
            "critic.ppo_micro_batch_size_per_device",
            4,
            "Responses per data-parallel rank per critic forward/backward pass.",
            Bound(lo=1, when="critic"),
        ),
        (
            "critic.forward_micro_batch_size_per_device",
            16,
            "Responses per data-parallel rank per value forward pass.",
            Bound(lo=1, when="critic"),
        ),
        ("critic.ppo_epochs", 1, "Critic passes over each training batch.", Bound(lo=1, when="critic")),
        ("critic.shuffle", False, "Reshuffle the critic's mini-batches at every epoch."),
        ("critic.grad_clip", 1.0, "Critic global gradient-norm clip; <= 0 disables clipping."),
        (
            "critic.cliprange_value",
            0.5,
            "Value clipping range around the old values.",
            Bound(lo=0, ends="(]", when="critic"),
        ),
        ("critic.loss_agg_mode", "token-mean", "Value-loss aggregation (same modes as the actor's)."),
        # --- reward (verl) ---------------------------------------------------------------------
        (
            "reward_model.enable",
            False,
            "Score responses with a reward model (else only the rule-based / custom reward function).",
        ),
        (
            "reward_model.model.path",
            "",
            "Reward model: HF checkpoint directory, 'preset:NAME', or empty = jaxflow.model.preset randomly initialised "
            "(benchmarks).",
        ),
        (
            "reward_model.model.use_remove_padding",
            False,
            "Reward (and cost) model forwards over packed real tokens (no padding; same scores).",
        ),
        (
            "reward_model.micro_batch_size_per_device",
            16,
            "Responses per data-parallel rank per reward-model forward pass.",
            AT_LEAST_1,
        ),
        (
            "custom_reward_function.path",
            _opt(str),
            "Python file with a user reward function; None = built-in scorers by data_source.",
        ),
        (
            "reward_model.overlong_buffer.enable",
            False,
            "DAPO's overlong reward shaping: the rule reward of a response longer than data.max_response_length - len "
            "tokens falls linearly, to -penalty_factor at data.max_response_length.",
        ),
        ("reward_model.overlong_buffer.len", 0, "Overlong shaping: the buffer's tokens (> 0 when enabled)."),
        ("reward_model.overlong_buffer.penalty_factor", 0.0, "Overlong shaping: the penalty at the response limit."),
        (
            "reward_model.overlong_buffer.log",
            False,
            "Overlong shaping: also report overlong_reward and overlong (1 when penalised) per response, as the "
            "reward's named values (reward_extra/*).",
        ),
        ("custom_reward_function.name", "compute_score", "Function name in that file."),
        # --- algorithm (verl) --------------------------------------------------------------------
        (
            "algorithm.adv_estimator",
            "gae",
            "Advantage estimator: gae | grpo | remax | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | opo | "
            "gpg | grpo_passk | gdpo | optimal_token_baseline | tir_optimal_token_baseline | a registered name.",
        ),
        (
            "algorithm.gdpo_reward_keys",
            [],
            "gdpo: the reward dimensions, keys of the dict the reward function returns (e.g. [format_reward,"
            "accuracy_reward]); each is normalised within its group before they are added.",
        ),
        (
            "algorithm.gdpo_reward_weights",
            _opt(list),
            "gdpo: one weight per gdpo_reward_keys entry; None = all 1.",
        ),
        ("algorithm.gamma", 1.0, "Discount factor (gae, reinforce_plus_plus).", FRACTION),
        ("algorithm.lam", 1.0, "GAE lambda.", FRACTION),
        ("algorithm.norm_adv_by_std_in_grpo", True, "GRPO: divide by the group's reward std (False = Dr. GRPO)."),
        ("algorithm.use_kl_in_reward", False, "Subtract kl_ctrl.kl_coef * KL(actor || ref) from the token rewards."),
        (
            "algorithm.kl_penalty",
            "kl",
            "KL estimator of the in-reward penalty: kl | abs | mse | low_var_kl (+ suffix allowed).",
        ),
        ("algorithm.kl_ctrl.type", "fixed", "KL coefficient controller: fixed | adaptive."),
        ("algorithm.kl_ctrl.kl_coef", 0.001, "(Initial) in-reward KL coefficient.", AT_LEAST_0),
        (
            "algorithm.kl_ctrl.horizon",
            10000,
            "Adaptive controller horizon (responses).",
            Bound(lo=0, ends="(]", note=" for the adaptive controller", when="adaptive_kl"),
        ),
        (
            "algorithm.kl_ctrl.target_kl",
            0.1,
            "Adaptive controller target KL.",
            Bound(lo=0, ends="(]", note=" for the adaptive controller", when="adaptive_kl"),
        ),
        (
            "algorithm.rollout_correction.bypass_mode",
            False,
            "Train against the rollout engine's log-probs (no old-log-prob forward) with the bypass_mode policy loss, "
            "which then replaces actor.policy_loss.loss_mode (as verl).",
        ),
        (
            "algorithm.rollout_correction.loss_type",
            "ppo_clip",
            "bypass_mode's loss: ppo_clip (PPO against the rollout policy) | reinforce (REINFORCE with the IS weights).",
        ),
        (
            "algorithm.rollout_correction.rollout_is",
            _opt(str),
            "bypass_mode: importance weights pi_train / pi_rollout per token | sequence; None = none.",
        ),
        (
            "algorithm.rollout_correction.rollout_is_threshold",
            "2.0",
            "Their bound: a number (truncation, TIS) or 'lower_upper' (weights outside are zeroed, IcePop).",
        ),
        (
            "algorithm.rollout_correction.rollout_is_batch_normalize",
            False,
            "Rescale the IS weights to mean 1 over the batch.",
        ),
        (
            "algorithm.rollout_correction.rollout_rs",
            _opt(str),
            "bypass_mode: rejection sampling, comma-separated criteria (token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3,"
            " seq_max_k2|k3); rejected tokens leave the loss; None = none.",
        ),
        (
            "algorithm.rollout_correction.rollout_rs_threshold",
            _opt(str),
            "Their thresholds: one for all or one per criterion (comma-separated); *_k1 take 'lower_upper' ratio bounds.",
        ),
        (
            "algorithm.filter_groups.enable",
            False,
            "DAPO's dynamic sampling: train only on prompt groups whose filter_groups.metric varies across their "
            "samples, generating more prompt batches of data.train_batch_size until the batch is full.",
        ),
        (
            "algorithm.filter_groups.metric",
            _opt(str),
            "filter_groups: seq_reward (summed token_level_scores) | seq_final_reward (summed token_level_rewards, after "
            "the in-reward KL) | acc (the reward function's score before shaping) | a key of the reward function's dict.",
        ),
        (
            "algorithm.filter_groups.max_num_gen_batches",
            0,
            "filter_groups: the most generation batches per step; more is an error (as verl); <= 0 = no limit.",
        ),
        # --- trainer (verl) ----------------------------------------------------------------------
        (
            "trainer.total_epochs",
            1,
            "Passes over the training prompts (when total_training_steps is None).",
            AT_LEAST_1,
        ),
        (
            "trainer.total_training_steps",
            _opt(int),
            "Training steps; None = total_epochs * steps per epoch. When set it wins (the data loader wraps around).",
            AT_LEAST_1,
        ),
        ("trainer.project_name", "jaxflow", "Project name (loggers, checkpoint directory)."),
        ("trainer.experiment_name", "base", "Experiment name (loggers, checkpoint directory)."),
        ("trainer.logger", ["console"], "Metric sinks: any of console, jsonl, tensorboard, wandb."),
        ("trainer.log_val_generations", 0, "Validation generations printed / logged per validation.", AT_LEAST_0),
        ("trainer.save_freq", -1, "Checkpoint every this many steps (and at the end); -1 = never.", STEPS_OR_NEVER),
        (
            "trainer.save_hf",
            False,
            "Also write the actor as an HF directory (safetensors + tokenizer) into each checkpoint's step_N/hf_actor; "
            "the end of a run always writes <run dir>/hf_actor.",
        ),
        ("trainer.test_freq", -1, "Validate every this many steps (and at the end); -1 = never.", STEPS_OR_NEVER),
        ("trainer.val_before_train", True, "Validate once before the first step."),
        ("trainer.critic_warmup", 0, "Steps that train only the critic before the actor starts.", AT_LEAST_0),
        (
            "trainer.mode",
            "sync",
            "sync | one_step_off | async. one_step_off: each update consumes the rollout of the previous weights "
            "(verl's one-step-off policy); async: rollouts of up to trainer.max_staleness policy versions back. "
            "Local and Ray backends, PPO/GRPO/RLOO/REINFORCE++. The rollouts run between the updates on the "
            "actor's devices, or (jaxflow.placement.rollout_devices > 0) on a rollout pool of their own, overlapping "
            "the updates, its weights synced after each.",
        ),
        (
            "trainer.max_staleness",
            1,
            "trainer.mode=async: policy versions between a rollout's weights and the update that consumes it "
            "(0 = sync, bit for bit); each update checks every consumed token's recorded version against it. "
            "Measured on the default task: README, Asynchronous modes.",
            AT_LEAST_0,
        ),
        (
            "trainer.partial_rollout",
            False,
            "trainer.mode one_step_off / async on a rollout pool (jaxflow.placement.rollout_devices, local or Ray; "
            "verl's async_training.partial_rollout): a weight sync interrupts the rollout in flight at the end of its "
            "segment (trainer.partial_rollout_segment tokens per row) instead of waiting for it; it keeps its tokens and "
            "rollout log-probs and "
            "resumes under the new weights (prompt and tokens so far prefilled again); every token records the policy "
            "version that sampled it, and each update checks their staleness. No effect without rollouts ahead "
            "(sync, max_staleness=0).",
        ),
        (
            "trainer.partial_rollout_segment",
            16,
            "trainer.partial_rollout: tokens per row a rollout samples between two chances to park for a sync. Each "
            "segment after the first prefills the prompt and the tokens so far again, so smaller segments interrupt "
            "sooner and cost more prefill; a response shorter than one segment is never interrupted (the default "
            "task's 4-token responses need 1-3). Measured: README, Asynchronous modes.",
            AT_LEAST_1,
        ),
        (
            "trainer.balance_batch",
            False,
            "Log verl's global_seqlen/* metrics: real tokens per actor data-parallel rank in the packed update, as "
            "contiguous blocks would give them and as dealt. Packed passes (use_remove_padding) always deal rows to ranks "
            "balanced by tokens, per pass; padded passes compute the same padded rows on every rank.",
        ),
        (
            "trainer.resume_mode",
            "auto",
            "disable | auto (latest checkpoint in default_local_dir, if any) | resume_path (resume_from_path).",
        ),
        ("trainer.resume_from_path", _opt(str), "Checkpoint directory to resume from when resume_mode is resume_path."),
        (
            "trainer.default_local_dir",
            "",
            "Checkpoint directory; empty = checkpoints/<project_name>/<experiment_name>.",
        ),
        (
            "trainer.max_actor_ckpt_to_keep",
            _opt(int),
            "Keep this many latest actor checkpoints; None = all.",
            AT_LEAST_1,
        ),
        (
            "trainer.max_critic_ckpt_to_keep",
            _opt(int),
            "Keep this many latest critic checkpoints; None = all.",
            AT_LEAST_1,
        ),
        ("trainer.seed", 0, "Seed of parameter init, sampling and dropout-free randomness."),
        # --- jaxflow: system -------------------------------------------------------------------
        ("jaxflow.job", "rl", "What the run does: rl (the RL loop) | sft (supervised warm start, see jaxflow.sft)."),
        (
            "jaxflow.backend",
            "local",
            "Driver: local (one process drives all devices) | ray (one Ray actor per host per worker group).",
        ),
        (
            "jaxflow.ray.address",
            "",
            "ray backend: cluster to join (e.g. 'head:6379' or 'ray://head:10001'; 'auto' joins any Ray instance on this "
            "machine, even another process's private one); empty = RAY_ADDRESS, else a cluster started with `ray start` "
            "on this machine, else a private Ray instance that the run starts and stops.",
        ),
        (
            "jaxflow.ray.devices_per_host",
            8,
            "ray backend: accelerators per host, one process per host per worker group (CPU: simulated devices per "
            "process); jaxflow.num_devices / devices_per_host hosts, and every pool takes whole hosts.",
            AT_LEAST_1,
        ),
        ("jaxflow.ray.accelerator", "cpu", "ray backend: cpu | gpu | tpu (what a host bundle asks Ray for)."),
        ("jaxflow.ray.cpus_per_host", 1.0, "ray backend: CPU cores in each host's bundle.", POSITIVE),
        (
            "jaxflow.ray.tpu_topology",
            "",
            "ray backend on TPU: each pool reserves whole slices of this topology (e.g. '4x4', with jaxflow.ray.tpu_version) "
            "through ray.util.tpu; empty = one bundle per TPU VM (STRICT_SPREAD).",
        ),
        ("jaxflow.ray.tpu_version", "", "ray backend on TPU: the slices' TPU generation (e.g. 'v5p', 'v6e')."),
        (
            "jaxflow.ray.compile_deadline_s",
            900.0,
            "ray backend: deadline of a worker call that compiles (a method's first call with given shapes, role builds).",
            POSITIVE,
        ),
        ("jaxflow.ray.step_deadline_s", 600.0, "ray backend: deadline of every other worker call.", POSITIVE),
        (
            "jaxflow.ray.sync_deadline_s",
            180.0,
            "ray backend: deadline of world set-up (jax.distributed.initialize) and of the other ranks after one failed.",
            POSITIVE,
        ),
        (
            "jaxflow.ray.schedule_timeout_s",
            60.0,
            "ray backend: a worker group whose host bundles the cluster cannot place within this is reported.",
            POSITIVE,
        ),
        (
            "jaxflow.ray.max_restarts",
            0,
            "ray backend: after a worker process dies or a call passes its deadline, stop every group, start fresh "
            "processes and resume from the last complete checkpoint, at most this many times; 0 = stop with the error.",
            AT_LEAST_0,
        ),
        (
            "jaxflow.num_devices",
            8,
            "Devices the run uses; on CPU this many devices are simulated (XLA host platform device count).",
            AT_LEAST_1,
        ),
        (
            "jaxflow.placement.type",
            "auto",
            "auto (the auto-mapper picks pools and every mesh at start-up; jaxflow.mesh.* are then set by it) | colocated "
            "(all roles on all devices) | split (actor+ref / critic+reward+cost) | custom (jaxflow.placement.groups).",
        ),
        (
            "jaxflow.placement.device_kind",
            "",
            "auto: device profile the auto-mapper plans for (a100-80g, h100, tpu-v5p, cpu, ... or a profile .json); "
            "empty = the local devices' kind.",
        ),
        (
            "jaxflow.placement.devices_per_host",
            0,
            "auto: devices per host (tensor parallelism stays within a host); 0 = the device profile's.",
        ),
        (
            "jaxflow.placement.groups",
            "",
            "custom: pools in device order, ';' between pools, ',' between the roles of a pool, e.g. "
            "'actor,ref;critic;reward'.",
        ),
        (
            "jaxflow.placement.pool_sizes",
            (),
            "split / custom: devices per pool, in pool order, summing to num_devices (less rollout_devices); "
            "empty = equal pools.",
        ),
        (
            "jaxflow.placement.rollout_devices",
            0,
            "The last this many devices form the rollout pool: the actor generates there (generation tp "
            "jaxflow.mesh.actor.generate.tp, replicas over the pool) with its weights synced after each update, "
            "overlapping the update in trainer.mode one_step_off / async; every other pool shares the first "
            "num_devices - rollout_devices. 0 = rollouts on the actor's own devices. Placement colocated / split / "
            "custom; local backend (synced by reshard) or Ray (whole hosts of jaxflow.ray.devices_per_host, a "
            "worker group of its own, synced by a weight stream between the two jax.distributed worlds).",
            AT_LEAST_0,
        ),
        *_mesh_fields("jaxflow.mesh.actor.train", "actor training / log-prob", tp=2),
        (
            "jaxflow.mesh.actor.generate.tp",
            2,
            "actor generation tensor parallelism; must divide the training weight-parallel degree fsdp*tp (the rest becomes"
            " generation dp).",
            AT_LEAST_1,
        ),
        *_mesh_fields("jaxflow.mesh.critic", "critic"),
        *_mesh_fields("jaxflow.mesh.ref", "reference policy"),
        *_mesh_fields("jaxflow.mesh.reward", "reward model"),
        *_mesh_fields("jaxflow.mesh.cost", "cost model (safe_rlhf)"),
        # --- jaxflow: model --------------------------------------------------------------------
        (
            "jaxflow.model.preset",
            "tiny_llama",
            "Shape preset from jaxflow.models.PRESETS for models whose path is empty.",
        ),
        ("jaxflow.model.vocab_size", 128, "Preset override: vocabulary rows (>= the tokenizer's); 0 = the preset's."),
        ("jaxflow.model.hidden_size", 128, "Preset override: model width; 0 = the preset's."),
        ("jaxflow.model.intermediate_size", 384, "Preset override: MLP width; 0 = the preset's."),
        ("jaxflow.model.num_layers", 4, "Preset override: decoder layers; 0 = the preset's."),
        (
            "jaxflow.model.num_heads",
            8,
            "Preset override: query heads (head_dim = hidden_size / num_heads); 0 = the preset's.",
        ),
        ("jaxflow.model.num_kv_heads", 4, "Preset override: key/value heads (GQA); 0 = the preset's."),
        (
            "jaxflow.model.dtype",
            "auto",
            "Parameter dtype: auto | float32 | bfloat16 | float16. auto: float32 on CPU; on GPU and TPU float32 "
            "master weights for the trained roles (actor, critic) and bfloat16 for the frozen ones (reference, "
            "reward and cost models).",
        ),
        (
            "jaxflow.model.compute_dtype",
            "auto",
            "Matmul dtype: auto | float32 | bfloat16 | float16 (norms, softmax, log-softmax, losses stay float32). "
            "auto: float32 on CPU, bfloat16 on GPU and TPU. A compute dtype narrower than the actor's weights "
            "makes the rollout's generation copy that dtype (bfloat16 generation from float32 masters).",
        ),
        (
            "jaxflow.model.scan_layers",
            False,
            "Scan over stacked layers in training and scoring (one compiled layer: faster compiles; the rollout "
            "still decodes layer by layer). On an H200 (0.5B, GRPO): first step 39.7 s vs 74.8 s from a cold "
            "cache, but each step ~11% slower: for short runs and fast iteration (docs/PERFORMANCE.md).",
        ),
        ("jaxflow.model.remat_policy", "none", "Rematerialisation in training: none | full | dots | dots_no_batch."),
        ("jaxflow.optim.state_dtype", "float32", "dtype of the AdamW moments: float32 | bfloat16."),
        # --- jaxflow: data / reward / trainer ----------------------------------------------------
        (
            "jaxflow.data.builtin_task",
            "addition",
            "Built-in task when data files are empty: addition | sort | reverse | reverse_digits | calculator (a tool "
            "task: multi-turn rollouts with the calculator tool) | code (one-line functions scored by hidden tests in "
            "the sandbox).",
        ),
        ("jaxflow.data.addition_digits", 1, "Built-in addition task: operands have this many digits (1: 0+0 .. 9+9)."),
        (
            "jaxflow.data.tool_fraction",
            0.25,
            "Built-in calculator task: share of the warm start's product demonstrations that call the tool (the "
            "others answer directly).",
            Bound(0, 1, "[]"),
        ),
        (
            "jaxflow.data.sum_fraction",
            0.0,
            "Built-in calculator task: share of the warm start's demonstrations that are sums worked through the tool "
            "(teaching the call and copying its answer; RL and the held-out problems are products).",
            Bound(0, 1, "[]"),
        ),
        ("jaxflow.data.num_train_examples", 4096, "Built-in task: training prompts drawn."),
        ("jaxflow.data.num_val_examples", 256, "Built-in task: validation prompts drawn (test split).", AT_LEAST_1),
        ("jaxflow.data.tokenizer", "char", "Tokenizer: char (built-in, 100 ids) or a directory / tokenizer.json path."),
        (
            "jaxflow.reward.timeout_s",
            5.0,
            "Per-response time limit of a custom reward function (then it scores 0).",
            Bound(lo=0, ends="(]", note=" seconds"),
        ),
        (
            "jaxflow.reward.batch_timeout_s",
            60.0,
            "Time limit of one batch's custom reward calls; samples unscored by then score 0 (counted as timeouts).",
            Bound(lo=0, ends="(]", note=" seconds"),
        ),
        (
            "jaxflow.reward.load_timeout_s",
            60.0,
            "Time limit for importing custom_reward_function.path (in a worker, before the run builds anything else).",
            Bound(lo=0, ends="(]", note=" seconds"),
        ),
        (
            "jaxflow.reward.max_failure_fraction",
            0.5,
            "Stop the run when more than this fraction of the reward calls of the last 5 batches failed (errors and "
            "timeouts); a batch whose every sample fails always stops it. 1.0 = only that.",
            Bound(0, 1, "(]"),
        ),
        (
            "jaxflow.reward.sandbox",
            "required",
            "The code reward's (data_source jaxflow/code) untrusted code: required = run it isolated (new user, "
            "network, mount and PID namespaces, CPU/memory/file/process limits) and refuse it where the OS cannot "
            "isolate it; off = the limits without isolation (trusted code only). Samples run in parallel.",
        ),
        (
            "jaxflow.trainer.max_nonfinite_steps",
            3,
            "Abort after this many consecutive steps with a non-finite loss or gradient (those updates are skipped).",
            AT_LEAST_0,
        ),
        (
            "jaxflow.rollout_probe.enable",
            "auto",
            "After each weight sync the rollout's and the trainer's weights score a fixed probe sequence; the run stops "
            "when their next-token distributions differ by more than jaxflow.rollout_probe.tolerance (metric "
            "rollout/probe_tv every step): auto (with LoRA) | on | off.",
        ),
        (
            "jaxflow.rollout_probe.tolerance",
            0.05,
            "Largest total variation distance allowed between the rollout's and the trainer's next-token "
            "distributions on the probe (max over its positions; dtype noise: ~1e-6 in float32, ~1e-2 in bfloat16).",
        ),
        (
            "jaxflow.trainer.resume_other_experiment",
            False,
            "Resume a checkpoint that records another experiment (algorithm, task, roles or model shapes differ from "
            "this run's); false = refuse it in one line naming the differences, before anything in the directory "
            "changes.",
        ),
        (
            "jaxflow.trainer.compile_ahead",
            "auto",
            "Compile the programs of a step concurrently, before step 1, into the persistent compilation cache "
            "(the local backend, with the cache on): auto (on GPU and TPU) | on | off.",
        ),
        (
            "jaxflow.trainer.rollout_agreement",
            False,
            "Train-rollout agreement mode: the actor's model is batch-invariant (every sum in index order, exp and "
            "log from exact elementwise arithmetic: jaxflow.models.ordered), so the rollout's log-probs equal the "
            "trainer's bit for bit; every step the trainer re-scores the sampled tokens (old_log_probs), also where an "
            "on-policy update would reuse its own forward, and logs training/rollout_* (the difference to the rollout "
            "engine's log-probs). Cost: that forward, and slower compiled programs (sums as sequential loops): for "
            "checking, not for speed.",
        ),
        # --- jaxflow: SFT warm start -------------------------------------------------------------
        ("jaxflow.sft.steps", 300, "sft job: optimizer steps on the built-in task's demonstrations."),
        (
            "jaxflow.sft.warm_start_steps",
            0,
            "rl job: first run this many sft steps (jaxflow.sft.*) and start RL from them, when "
            "actor_rollout_ref.model.path is empty; 0 = no warm start.",
        ),
        ("jaxflow.sft.lr", 1e-3, "sft job: peak learning rate (AdamW, linear warmup then constant)."),
        ("jaxflow.sft.warmup_steps", 10, "sft job: warmup steps."),
        ("jaxflow.sft.weight_decay", 0.0, "sft job: AdamW weight decay."),
        ("jaxflow.sft.batch_size", 64, "sft job: demonstrations per optimizer step."),
        (
            "jaxflow.sft.micro_batch_size_per_device",
            8,
            "sft job: demonstrations per data-parallel rank per forward/backward pass.",
        ),
        (
            "jaxflow.sft.test_freq",
            50,
            "sft job: greedy accuracy on the test split every this many steps; -1 = never.",
            STEPS_OR_NEVER,
        ),
        (
            "jaxflow.sft.output_dir",
            "checkpoints/jaxflow/sft_tiny",
            "sft job: where the final HF checkpoint (+ tokenizer) is written; RL configs start from it via "
            "actor_rollout_ref.model.path.",
        ),
        # --- jaxflow: Safe RLHF ------------------------------------------------------------------
        (
            "jaxflow.safe_rlhf.enable",
            False,
            "Safe RLHF: maximise reward subject to E[cost] <= cost_threshold via a Lagrange multiplier.",
        ),
        (
            "jaxflow.safe_rlhf.cost_model_path",
            "",
            "Cost model: HF checkpoint directory or 'preset:NAME'; empty = the rule cost_rule.",
        ),
        (
            "jaxflow.safe_rlhf.cost_rule",
            "forbidden_chars",
            "Rule-based cost: forbidden_chars (1 if the response contains any of forbidden_chars, else 0) | length "
            "(response tokens incl. EOS).",
        ),
        ("jaxflow.safe_rlhf.forbidden_chars", "9", "Characters the forbidden_chars rule penalises."),
        ("jaxflow.safe_rlhf.cost_threshold", 0.1, "Constraint threshold d on the mean episode cost."),
        ("jaxflow.safe_rlhf.lambda_init", 1.0, "Initial Lagrange multiplier (> 0 for the log scale)."),
        ("jaxflow.safe_rlhf.lambda_lr", 0.05, "Multiplier step size eta: lambda <- lambda + eta (J_C - d)."),
        (
            "jaxflow.safe_rlhf.lambda_update_scale",
            "linear",
            "Multiplier update on a linear scale (projected at 0) or a log scale.",
        ),
        ("jaxflow.safe_rlhf.lambda_max", _opt(float), "Upper bound on the multiplier; None = unbounded."),
        # --- jaxflow: dry run --------------------------------------------------------------------
        (
            "jaxflow.dry_run.enable",
            False,
            "Plan and compile ahead of time on jaxflow.num_devices simulated CPU devices (abstract inputs, no weights); "
            "report per-device memory, train nothing.",
        ),
        (
            "jaxflow.dry_run.device_memory_gib",
            80.0,
            "Dry run: per-device memory budget the compiled programs are checked against.",
            POSITIVE,
        ),
    ]
)

KEY_DOCS: dict[str, str] = {f.key: f.doc for f in FIELDS}
BOUNDS: dict[str, Bound] = {f.key: f.bound for f in FIELDS if f.bound is not None}


def _type_of(default: Any) -> tuple[type, bool]:
    if isinstance(default, Optional_):
        return default.type, True
    return type(default), False


# key -> (type, optional). Used by apply_overrides (for fields whose value is None) and validate.
KEY_TYPES: dict[str, tuple[type, bool]] = {f.key: _type_of(f.default) for f in FIELDS}

DEFAULTS: dict[str, Any] = {f.key: (None if isinstance(f.default, Optional_) else f.default) for f in FIELDS}


def get_base_config() -> ConfigDict:
    """A fresh ConfigDict with every key at its default (unlocked, so named configs may edit
    it; :func:`jaxflow.configs.get_config` locks what it returns)."""
    cfg = ConfigDict()
    for key, default, *_ in FIELDS:
        *parents, leaf = key.split(".")
        node = cfg
        for name in parents:
            if name not in node:
                node[name] = ConfigDict()
            node = node[name]
        if isinstance(default, Optional_):
            node[leaf] = config_dict.placeholder(default.type)
        else:
            node[leaf] = list(default) if isinstance(default, list) else default
    return cfg


def tiny_config(
    name: str, adv_estimator: str = "gae", *, kl_in_reward: bool = False, kl_loss_type: str = ""
) -> ConfigDict:
    """The base config with the settings shared by the ``*_tiny`` configs: a self-contained CPU
    run of a few minutes that visibly learns one-digit addition (300 steps, validation every 50,
    no checkpoints; a rerun resumes from the run directory's checkpoints if it has any).

    The algorithm: ``adv_estimator`` (a critic for ``gae`` only), the KL to the reference
    either in the reward (``kl_in_reward``) or as a loss (``kl_loss_type``), at 0.001."""
    cfg = get_base_config()
    cfg.trainer.experiment_name = name
    cfg.algorithm.adv_estimator = adv_estimator
    cfg.critic.enable = adv_estimator == "gae"
    if kl_in_reward:
        cfg.algorithm.use_kl_in_reward = True
        cfg.algorithm.kl_ctrl.kl_coef = 0.001
    if kl_loss_type:
        cfg.actor_rollout_ref.actor.use_kl_loss = True
        cfg.actor_rollout_ref.actor.kl_loss_type = kl_loss_type
        cfg.actor_rollout_ref.actor.kl_loss_coef = 0.001
    cfg.trainer.total_training_steps = 300
    cfg.trainer.test_freq = 50
    cfg.trainer.logger = ["console", "jsonl"]
    # One-digit addition ("3+5=" -> "8"): prompts of 5 tokens, answers of at most 3 (with EOS).
    cfg.jaxflow.data.addition_digits = 1
    cfg.data.max_prompt_length = 8
    cfg.data.max_response_length = 4
    cfg.jaxflow.model.num_layers = 2
    # A short supervised warm start teaches the answer format (score still <= 0.2); RL does the rest.
    cfg.jaxflow.sft.warm_start_steps = 40
    # 32 prompts x 8 responses per step, 4 mini-batches (optimizer steps) of 8 prompts.
    cfg.data.train_batch_size = 32
    cfg.actor_rollout_ref.rollout.n = 8
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_device = 16  # 64 responses over 4 dp ranks
    cfg.actor_rollout_ref.actor.optim.lr = 3e-4
    # Cosine decay to 0.1 x lr: fast early learning, a stable end (constant lr drifts back down).
    cfg.actor_rollout_ref.actor.optim.warmup_style = "cosine"
    cfg.actor_rollout_ref.actor.optim.min_lr_ratio = 0.1
    cfg.critic.ppo_mini_batch_size = 8
    cfg.critic.ppo_micro_batch_size_per_device = 8  # the critic shards over all 8 devices (fsdp)
    for role in (cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref):
        role.log_prob_micro_batch_size_per_device = 64
    cfg.critic.forward_micro_batch_size_per_device = 64
    return cfg


# --- the paper's workloads (ppo_7b ... ppo_70b) ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PaperWorkload:
    """One of HybridFlow's PPO workloads: the models' preset, the devices, and the paper's
    hand-picked layout on each half (``actor_train`` / ``critic``: (dp, fsdp, tp); the
    actor's generation tp), micro-batch and decode slots."""

    preset: str
    num_devices: int
    actor_train: tuple[int, int, int]
    actor_gen_tp: int
    critic: tuple[int, int, int]
    micro_batch_size_per_device: int
    max_num_seqs: int


PAPER_WORKLOADS = {
    "ppo_7b": PaperWorkload("llama2_7b", 16, (1, 4, 2), 2, (1, 4, 2), 8, 32),
    "ppo_13b": PaperWorkload("llama2_13b", 32, (2, 4, 2), 4, (1, 8, 2), 4, 32),
    "ppo_34b": PaperWorkload("codellama_34b", 64, (1, 8, 4), 4, (1, 8, 4), 2, 128),
    "ppo_70b": PaperWorkload("llama2_70b", 128, (1, 8, 8), 8, (1, 8, 8), 2, 128),
}


def paper_ppo_config(name: str) -> ConfigDict:
    """HybridFlow's PPO workload (arXiv 2409.19256, section 8): actor, critic, reference and
    reward model all of one size; 1024 prompts per step, 1024-token prompts and responses,
    one PPO epoch of 8 mini-batches of 128 prompts; bf16 weights, fp32 Adam moments.

    ``name``: a `PAPER_WORKLOADS` row. Placement ``split`` (the paper's hand-picked layout,
    kept so the benchmark stays comparable): actor+ref on the first half of the devices,
    critic+reward on the second, the actor and critic as the row says; ``ref`` and
    ``reward`` shard fully (fsdp) over theirs. ``--config.jaxflow.placement.type=auto`` lets the auto-mapper
    choose instead, planning for A100-80G hosts of 8 (``jaxflow.placement.device_kind``).
    Prompts come from the built-in task unless ``data.train_files`` is set: throughput does
    not depend on their content, since prompts are left-padded to 1024 tokens and
    ``ignore_eos`` generates all 1024 response tokens.
    """
    w = PAPER_WORKLOADS[name]
    cfg = get_base_config()
    cfg.trainer.experiment_name = name
    cfg.trainer.project_name = "jaxflow_paper"
    cfg.trainer.total_training_steps = 10
    cfg.trainer.val_before_train = False
    cfg.trainer.test_freq = -1
    cfg.trainer.save_freq = -1
    cfg.trainer.logger = ["console", "jsonl"]

    cfg.data.max_prompt_length = 1024
    cfg.data.max_response_length = 1024
    cfg.data.train_batch_size = 1024
    cfg.data.truncation = "left"
    cfg.jaxflow.data.num_train_examples = 16384
    cfg.jaxflow.data.num_val_examples = 1024

    cfg.algorithm.adv_estimator = "gae"
    cfg.algorithm.use_kl_in_reward = True
    cfg.critic.enable = True
    cfg.reward_model.enable = True
    cfg.reward_model.model.path = f"preset:{w.preset}"

    for role in (cfg.actor_rollout_ref.actor, cfg.critic):
        role.ppo_mini_batch_size = 128  # 1024 / 128 = 8 optimizer steps per PPO epoch
        role.ppo_micro_batch_size_per_device = w.micro_batch_size_per_device
        role.ppo_epochs = 1
    cfg.actor_rollout_ref.actor.optim.lr = 1e-6
    cfg.critic.optim.lr = 1e-5
    for key in ("actor_rollout_ref.rollout", "actor_rollout_ref.ref"):
        cfg[key].log_prob_micro_batch_size_per_device = w.micro_batch_size_per_device
    cfg.critic.forward_micro_batch_size_per_device = w.micro_batch_size_per_device
    cfg.reward_model.micro_batch_size_per_device = w.micro_batch_size_per_device
    cfg.actor_rollout_ref.rollout.ignore_eos = True
    cfg.actor_rollout_ref.rollout.max_num_seqs = w.max_num_seqs

    m = cfg.jaxflow.model
    m.preset = w.preset
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        m[key] = 0  # the preset's published shape
    m.dtype = "bfloat16"
    m.compute_dtype = "bfloat16"
    m.scan_layers = True
    m.remat_policy = "full"
    cfg.jaxflow.optim.state_dtype = "float32"

    cfg.jaxflow.num_devices = w.num_devices
    cfg.jaxflow.placement.type = "split"  # two equal pools
    # What jaxflow.placement.type=auto plans for: the paper's A100-80G hosts of 8.
    cfg.jaxflow.placement.device_kind = "a100-80g"
    cfg.jaxflow.placement.devices_per_host = 8
    mesh = cfg.jaxflow.mesh
    mesh.actor.train.dp, mesh.actor.train.fsdp, mesh.actor.train.tp = w.actor_train
    mesh.actor.generate.tp = w.actor_gen_tp
    mesh.critic.dp, mesh.critic.fsdp, mesh.critic.tp = w.critic
    cfg.jaxflow.ray.accelerator = "gpu"  # the paper's hosts: 8 GPUs each (backend=ray)
    return cfg
