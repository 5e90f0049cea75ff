"""The RL side of generation: the rollout manager (manager.py: dataset rounds, rewards, dynamic sampling,
pass@k, eval) and the reward worker pool (reward_pool.py). The engines and their contract are `rlbench.engine`.
"""
