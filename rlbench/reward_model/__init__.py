"""Reward models: train one from preference pairs (`train.run_rm`, `rlbench rm`), score rollouts with it
(`serve.RewardModel`, `--reward-model DIR`). The model is a value model (`rlbench.models.value_head`), the critic's layout."""
