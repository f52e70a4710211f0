"""jdllm.rl: jdllm as a rollout and scoring engine for reinforcement learning in JAX.

    state, spec = jdllm.rl.prepare_rollout(model, prompts, decoding, jdllm.Sampling(temperature=1.0,
                                           max_new_tokens=12), group=8)
    ro = jdllm.rl.rollout(params, state, key, spec=spec)          # pure: inside your jit
    lp = jdllm.rl.trajectory_logprobs(params, ro, spec=spec)      # differentiable replay of step_map
    adv = jdllm.rl.group_advantages(rewards, spec.group)
    loss = jdllm.rl.grpo_loss(lp, ro.logprobs, adv, ro.answer_mask)

See `examples/rl_grpo.py` for a whole GRPO loop with optax.
"""

from jdllm.rl.losses import AGGREGATES, group_advantages, grpo_loss, pg_loss
from jdllm.rl.replay import (METHODS, approximate_decode, check_params, check_rollout, default_method,
                             packed_attention_mask, replay_copies, replay_cost, token_logprobs,
                             trajectory_logprobs)
from jdllm.rl.rollouts import (Rollout, RolloutSpec, compiled_rollout, prepare_rollout, rollout,
                              select_groups, texts)

__all__ = ["prepare_rollout", "rollout", "compiled_rollout", "Rollout", "RolloutSpec", "select_groups", "texts",
           "trajectory_logprobs", "replay_copies", "token_logprobs", "check_rollout", "check_params", "replay_cost",
           "packed_attention_mask", "default_method", "approximate_decode", "METHODS", "group_advantages",
           "grpo_loss", "pg_loss", "AGGREGATES"]
